"""Can a DTensor mesh step read host memory one layer at a time? The probes behind
`--offload=optimizer+params` (ZeRO-3's parameters held on the host between gathers).

    python tools/probe_param_offload.py [--width=512 --depth=16 --devices=4]

A chain of `--depth` layers `h = tanh(h @ W_k)` (`W_k`: width x width, fp32) on a batch of 64
rows split over a 4-device `batch` mesh, loss `mean(h^2)`, each layer recomputed in the
backward pass as ZeRO-3's (`tfpar.zero.fsdp`); the weights are NumPy arrays of the process
(the host, outside TensorFlow's allocator, as `tfpar.offload` keeps Adam's slots) or, for
the baseline, DVariables split over `batch`. Each probe runs in its own process (TensorFlow
reads the DTensor switches when it compiles) and prints one line; the allocator's figures
are the whole process's (the logical CPUs share one allocator, `tfpar.memory`), the peak of
one step after a warm-up step:

    zero3                 the baseline: each layer's pieces (DVariables) gathered whole
                          (a relayout) before it runs and again in its backward pass, the
                          weights' gradients reduce-scattered onto the pieces
    numpy_function        each layer's weight from the host by `tf.numpy_function`
    py_function           the same by `tf.py_function`
    numpy_function+replicated, py_function+replicated
                          the same, each enrolled in DTensor's replicated expansion
                          (`DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.PYFUNC`, `...EAGERPYFUNC`):
                          every device would ask the host for the layer's whole weight,
                          forward and backward, and hand the weight's summed gradient back
                          by another host function (compared with one device's gradients)
    sink                  the other direction alone: the zero3 step, each layer's summed
                          weight gradient also handed to the host by a `tf.numpy_function`
                          with no output (enrolled as above; nothing of its output to lay out)
    file_readers          each layer's pieces in a host file (`/dev/shm`, NumPy's memmap: host
                          RAM outside TensorFlow's allocator), each device reading its own
                          piece with a `tf.data` reader of its own (DTensor's iterator
                          expansion, as `DTensorDataset` packs them, through DTensor's
                          private API; no Python in the step) in the layer (after its input
                          by a control edge) and again in its backward pass, the
                          gathers and reduce-scatters as zero3's; the pieces' gradients
                          are the step's outputs (nothing in a DTensor step can hand them to
                          the host: see sink)
    generator_readers     file_readers' readers fed by a Python generator reading the host's
                          NumPy arrays (`tf.data.Dataset.from_generator`) in place of a file
    file_readers+write_file  the same, each layer's summed weight gradient also written to
                          a host file by `tf.io.write_file` in the step (it and
                          `tf.io.serialize_tensor` enrolled as above)
    host_mesh             a variable on a separate one-device "host" mesh: does it leave the
                          devices' allocator? (the bytes it adds there)
"""

import argparse
import gc
import glob
import os
import shutil
import subprocess
import sys
import threading

PROBES = ("zero3", "numpy_function", "py_function", "numpy_function+replicated",
          "py_function+replicated", "sink", "generator_readers", "file_readers",
          "file_readers+write_file", "host_mesh")
REPLICATED = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF."
TIMEOUT = 240
ROWS = 64


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--probe", default="", help="run one probe in this process")
    args = parser.parse_args()
    if args.probe:
        return run_probe(args)
    mb = args.width * args.width * args.depth * 4 / 2 ** 20
    print(f"{args.depth} layers of {args.width}x{args.width} fp32 = {mb:.1f} MB of weights, "
          f"{args.devices} devices on `batch`, batch {ROWS}")
    for name in PROBES:
        before = set(glob.glob("/dev/shm/param_offload_*"))
        try:
            run_one(name, args)
        finally:
            for leftover in set(glob.glob("/dev/shm/param_offload_*")) - before:
                shutil.rmtree(leftover, ignore_errors=True)
    return 0


def run_one(name, args):
    """Runs probe `name` in a child process and prints its line."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    if name.endswith("+replicated") or name == "sink":
        env[REPLICATED + "PYFUNC"] = env[REPLICATED + "EAGERPYFUNC"] = "1"
    if name.endswith("write_file"):
        env[REPLICATED + "WRITEFILE"] = env[REPLICATED + "SERIALIZETENSOR"] = "1"
    try:
        proc = subprocess.run(
            [sys.executable, __file__, f"--probe={name}", f"--width={args.width}",
             f"--depth={args.depth}", f"--devices={args.devices}"],
            capture_output=True, text=True, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        print(f"{name}: no result in {TIMEOUT} s (the step never returned)")
        return
    lines = [l for l in proc.stdout.splitlines() if l.startswith(name + ":")]
    died = "killed by signal %d" % -proc.returncode if proc.returncode < 0 else \
        "exit %d" % proc.returncode
    print("\n".join(lines) or f"{name}: {died} in the first step, nothing printed")


def make_readers(host, mesh, rows, name):
    """Per layer, a DTensor iterator whose device i reads piece i of the layer's weight
    from a host file (a NumPy memmap the host would update between steps), `[batch,
    unsharded]`, a fresh read at every `next`. DTensor's own packing of per-device
    iterators (`input_util._pack_iterator_resource_dtensor`, private API)."""
    import tempfile

    import numpy as np
    import tensorflow as tf
    from tensorflow.dtensor.python import api, input_util
    from tensorflow.experimental import dtensor

    directory = tempfile.mkdtemp(prefix="param_offload_", dir="/dev/shm")
    n, (width, _) = mesh.dim_size("batch"), host[0].shape
    piece = host[0].nbytes // n
    options = tf.data.Options()
    options.autotune.enabled = False  # nothing read ahead of its `next`
    options.experimental_optimization.inject_prefetch = False
    host_layout = dtensor.Layout(rows.sharding_specs, mesh.host_mesh())
    readers = []
    for k, w in enumerate(host):
        path = os.path.join(directory, f"w{k}")
        np.memmap(path, np.float32, "w+", shape=w.shape)[...] = w
        iterators = []
        for i, device in enumerate(mesh.host_mesh().local_devices()):
            with tf.device(device):
                if name.startswith("generator"):
                    def rows_of(w=w, i=i):
                        while True:
                            yield w[i * width // n:(i + 1) * width // n]
                    ds = tf.data.Dataset.from_generator(rows_of, output_signature=(
                        tf.TensorSpec((width // n, width), tf.float32)))
                else:
                    ds = tf.data.FixedLengthRecordDataset(
                        path, piece, header_bytes=i * piece,
                        footer_bytes=(n - 1 - i) * piece).repeat()
                    ds = ds.map(lambda b: tf.reshape(tf.io.decode_raw(b, tf.float32),
                                                     (width // n, width)))
                iterators.append(iter(ds.with_options(options)))
        resource = api.pack([it._iterator_resource for it in iterators],
                            dtensor.Layout.replicated(mesh.host_mesh(), 0))
        api._dtensor_device().set_iterator_element_layouts(resource, [host_layout])
        readers.append(input_util._DTensorIterator(
            (resource,), tf.TensorSpec(w.shape, tf.float32), rows))

    class Readers(list):
        pass
    out = Readers(readers)
    out.directory = directory
    return out


def run_probe(args):
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    n, width, depth = args.devices, args.width, args.depth
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    mesh = dtensor.create_mesh([("batch", n)], devices=[f"CPU:{i}" for i in range(n)])
    whole = dtensor.Layout.replicated(mesh, 2)
    rows = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)
    scalar = dtensor.Layout.replicated(mesh, 0)
    rng = np.random.default_rng(0)
    host = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
            for _ in range(depth)]
    batch = rng.standard_normal((ROWS, width)).astype(np.float32)
    name = args.probe
    calls, sent = [], {}
    lock = threading.Lock()

    def mb(b):
        return f"{b / 2 ** 20:.1f} MB"

    def zero_of(t):  # 0.0 computed from `t`: what runs after it
        probe = tf.reduce_max(tf.reshape(t, [-1])[:1])
        return tf.where(probe == probe, 0.0, float("nan"))

    def fetch(k, zero):  # layer k's whole weight from the host
        if name.startswith("numpy_function"):
            out = tf.numpy_function(lambda z: host[k] + z, [zero], tf.float32, stateful=True)
        else:
            def read(z):
                with lock:
                    calls.append(z.device)
                return tf.constant(host[k]) + z
            out = tf.py_function(read, [zero], tf.float32)
        out.set_shape((width, width))
        return out

    def send(k, dw):  # layer k's summed weight gradient to the host; a 0.0 back
        if name.startswith("numpy_function") or name == "sink":
            def keep(g):
                with lock:
                    sent.setdefault(k, []).append(("host", np.array(g)))
            tf.numpy_function(keep, [dw], [], stateful=True)  # no output to lay out
            return tf.zeros([], tf.float32)

        def write(g):
            with lock:
                sent.setdefault(k, []).append((g.device, g.numpy().copy()))
            return tf.zeros([], tf.float32)
        out = tf.py_function(write, [dw], tf.float32)
        out.set_shape(())
        return out

    pieces = []
    readers = (make_readers(host, mesh, rows, name)
               if name.startswith(("file", "generator")) else None)
    if name in ("zero3", "sink"):
        pieces = [dtensor.DVariable(dtensor.relayout(
            dtensor.copy_to_mesh(tf.constant(w), whole), rows)) for w in host]

    def layer(k):
        @tf.custom_gradient
        def run(h, handle):  # handle: the piece (zero3) or a 0.0 standing for the weight
            def weight(zero):
                if readers is not None:
                    with tf.control_dependencies([zero, handle]):
                        piece = next(current[k])  # this device's piece, read now
                    return dtensor.relayout(piece + zero, whole)
                if pieces:
                    return dtensor.relayout(handle + zero, whole)  # the gather
                return fetch(k, handle + zero)

            out = tf.tanh(tf.matmul(h, weight(zero_of(h))))

            def grad(dy):
                w = weight(zero_of(dy))  # again, in the backward pass
                with tf.GradientTape() as tape:
                    tape.watch([h, w])
                    again = tf.tanh(tf.matmul(h, w))
                dh, dw = tape.gradient(again, [h, w], output_gradients=dy)
                if name == "sink":
                    with tf.control_dependencies([send(k, dw)]):
                        dw = tf.identity(dw)
                if name.endswith("write_file"):
                    path = os.path.join(readers.directory, f"grad{k}")
                    with tf.control_dependencies([tf.io.write_file(
                            path, tf.io.serialize_tensor(dw))]):
                        return dh, tf.zeros([], tf.float32)
                if readers is not None:  # the piece's gradient: a step output
                    collected[k] = dtensor.relayout(dw, rows)
                    return dh, tf.zeros([], tf.float32)
                if pieces:
                    return dh, dtensor.relayout(dw, rows)  # the reduce-scatter
                return dh, send(k, dw)
            return out, grad
        return run

    if name == "host_mesh":
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        one = dtensor.create_mesh([("host", 1)], devices=["CPU:0"])
        v = dtensor.DVariable(dtensor.copy_to_mesh(tf.constant(host[0]),
                                                   dtensor.Layout.replicated(one, 2)))
        after = tf.config.experimental.get_memory_info("CPU:0")["current"]
        print(f"{name}: a {mb(host[0].nbytes)} variable on a one-device mesh (CPU:0) adds "
              f"{mb(after - before)} to the devices' allocator")
        del v
        return 0

    x = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(batch), whole), rows)

    current, collected = [], {}

    @tf.function
    def step(x, its):
        current[:] = its
        if pieces:
            handles = [p.read_value() for p in pieces]
        else:
            handles = [dtensor.copy_to_mesh(tf.zeros([]), scalar) for _ in range(depth)]
        with tf.GradientTape() as tape:
            tape.watch(handles)
            h = x
            for k in range(depth):
                h = layer(k)(h, handles[k])
            loss = tf.reduce_mean(h * h)
        grads = tape.gradient(loss, handles)
        if name in ("file_readers", "generator_readers"):
            grads = [collected[k] for k in range(depth)]
        return loss, grads

    try:
        with dtensor.default_mesh(mesh):
            warm = step(x, list(readers or []))
            [t.numpy() for t in dtensor.unpack(warm[0])]  # the step has run
            del warm  # the warm-up step's outputs freed before measuring
            gc.collect()
            calls.clear()
            sent.clear()
            tf.config.experimental.reset_memory_stats("CPU:0")
            resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
            loss, grads = step(x, list(readers or []))
            [t.numpy() for g in grads for t in dtensor.unpack(g)]  # the step has run
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except Exception as err:  # the probe's result is the error's first line
        print(f"{name}: FAILED {type(err).__name__}: {str(err).strip().splitlines()[0][:300]}")
        return 0
    weights = [tf.Variable(w) for w in host]  # one device, plain TensorFlow
    with tf.GradientTape() as tape:
        h = tf.constant(batch)
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        ref_loss = tf.reduce_mean(h * h)
    ref = [g.numpy() for g in tape.gradient(ref_loss, weights)]
    if name.endswith("write_file"):
        got = [[tf.io.parse_tensor(tf.io.read_file(os.path.join(readers.directory,
                                                                f"grad{k}")),
                                   tf.float32).numpy()] for k in range(depth)]
    elif name in ("zero3", "file_readers", "generator_readers"):
        got = [[np.concatenate([p.numpy() for p in dtensor.unpack(g)])] for g in grads]
    else:
        got = [[g for _, g in sent.get(k, [])] for k in range(depth)]
    worst = max((float(np.max(np.abs(g - r))) for gs, r in zip(got, ref) for g in gs),
                default=float("nan"))
    loss = float(dtensor.unpack(loss)[0])
    extra = ""
    if calls or sent:
        devices = sorted({d.split("device:")[-1] for d in calls})
        extra = (f"; host reads {len(calls)} ({len(calls) // depth} a layer) from "
                 f"{','.join(devices)}, gradients sent {sum(len(v) for v in sent.values())}")
    print(f"{name}: step peak {mb(peak)}, of which {mb(resident)} resident before the step "
          f"(weights {mb(depth * host[0].nbytes)}); loss "
          f"{loss:.6g} vs one device {float(ref_loss):.6g}; max |dW - one device's| "
          f"{worst:.2e}{extra}")
    if readers is not None:
        shutil.rmtree(readers.directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
