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
                          expansion, as `DTensorDataset` packs them: the registry entry
                          `tfpar.patches.per_device_iterator`; no Python in the step)
                          in the layer (after its input by a control edge) and again in
                          its backward pass, the gathers and reduce-scatters as
                          zero3's; the pieces' gradients are the step's outputs
                          (nothing in a DTensor step can hand them to the host: see sink)
    generator_readers     file_readers' readers fed by a Python generator reading the host's
                          NumPy arrays (`tf.data.Dataset.from_generator`) in place of a file
    file_readers+write_file  the same, each layer's summed weight gradient also written to
                          a host file by `tf.io.write_file` in the step (it and
                          `tf.io.serialize_tensor` enrolled as above)
    host_mesh             a variable on a separate one-device "host" mesh: does it leave the
                          devices' allocator? (the bytes it adds there)

The training probes run `--steps` steps (lr 0.01) with an optimizer's state, measure the
last one and compare the weights after them with one device's Keras optimizer (Keras's own
`apply`) and, in the parent, each offloaded route's with its optimizer's zero3 route:

    train_zero3_adam, train_zero3_momentum
                          the baseline with Adam (or momentum SGD, 0.9): the slots are
                          DVariables split like the pieces, the update runs in the step
                          (Keras's formulas as TensorFlow ops), pieces and slots written
                          once at its end
    train_offload_adam, train_offload_momentum
                          file_readers trained: the pieces' summed gradients leave the step
                          as its outputs, the update runs on the host after it
                          (`tfpar.offload.adam_step` / `momentum_step` on the files' NumPy
                          memmaps and NumPy slots), and the next step's readers read the
                          new pieces
    train_offload_adam_at_start
                          the same, every piece read once at the step's start: does reading
                          in each layer (ordered by control edges) lower the step's peak?

`--probes=a,b` runs some; a training probe's CPU seconds a step (steps 2 on, the host
update included) are the process's and depend on the machine's load. `--cap_mb=C`
instead finds, for each training probe of `--probes`, the deepest chain of `--depths` that
trains with the process's allocator capped at C MB a device (`TF_CPU_BFC_MEM_LIMIT_IN_MB`
= C x devices, as tools/bench_memory.py caps it), one line each.
"""

import argparse
import gc
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import threading

PROBES = ("zero3", "numpy_function", "py_function", "numpy_function+replicated",
          "py_function+replicated", "sink", "generator_readers", "file_readers",
          "file_readers+write_file", "host_mesh")
# Training: each route a few steps with its optimizer's state, the update on the device
# (zero3) or on the host after the step (offload); compared pairwise by the parent.
TRAINING = ("train_zero3_adam", "train_offload_adam", "train_offload_adam_at_start",
            "train_zero3_momentum", "train_offload_momentum")
REPLICATED = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF."
TIMEOUT = 240
ROWS = 64
LR, BETA_1, BETA_2, EPSILON, MOMENTUM = 1e-2, 0.9, 0.999, 1e-7, 0.9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3,
                        help="training probes: steps (>= 2; the last one measured)")
    parser.add_argument("--probes", default=",".join(PROBES + TRAINING),
                        help="which probes, comma-separated")
    parser.add_argument("--probe", default="", help="run one probe in this process")
    parser.add_argument("--out", default="", help="a training probe's weights go here")
    parser.add_argument("--cap_mb", type=int, default=0,
                        help="instead: under this allocator cap per device, the deepest "
                             "chain of --depths each training probe of --probes trains")
    parser.add_argument("--depths", default="4,8,12,16,24,32,48,64,96,128")
    parser.add_argument("--skip_reference", action="store_true",
                        help="no one-device run (under a cap it would not fit)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: the training probes measure their last step "
                     "after a first one; use --steps=2 or more")
    if args.probe:
        return run_probe(args)
    if args.cap_mb:
        return capacity(args)
    mb = args.width * args.width * args.depth * 4 / 2 ** 20
    print(f"{args.depth} layers of {args.width}x{args.width} fp32 = {mb:.1f} MB of weights, "
          f"{args.devices} devices on `batch`, batch {ROWS}; training probes: {args.steps} "
          f"steps, lr {LR}")
    out = tempfile.mkdtemp(prefix="param_offload_weights_")
    try:
        for name in args.probes.split(","):
            run_one(name, args, out)
        compare(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return 0


def compare(out):
    """Each offloaded training probe's weights against its optimizer's zero3 run."""
    import numpy as np

    for name in TRAINING:
        base = "train_zero3_" + ("adam" if "adam" in name else "momentum")
        paths = [os.path.join(out, n + ".npz") for n in (name, base)]
        if name == base or not all(os.path.exists(p) for p in paths):
            continue
        got, ref = (np.load(p) for p in paths)
        worst = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref.files)
        print(f"{name} vs {base}: max |W diff| {worst:.2e}"
              + (" (bit-equal)" if worst == 0 else ""))


def capacity(args):
    """For each training probe of `--probes`, the deepest chain of `--depths` whose
    `--steps` steps run with the process's allocator capped at `--cap_mb` x devices
    (`TF_CPU_BFC_MEM_LIMIT_IN_MB`, as tools/bench_memory.py caps it): one line each."""
    names = [n for n in args.probes.split(",") if n in TRAINING]
    layer_mb = args.width * args.width * 4 / 2 ** 20
    print(f"cap {args.cap_mb} MB a device x {args.devices} devices; chains of "
          f"{args.width}x{args.width} fp32 layers ({layer_mb:.1f} MB each), {args.steps} "
          "steps")
    env = {"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(args.cap_mb * args.devices)}
    args.skip_reference = True
    out = tempfile.mkdtemp(prefix="param_offload_weights_")
    try:
        for name in names:
            largest, stopped = None, ""
            for depth in sorted(int(d) for d in args.depths.split(",")):
                line = run_one(name, args, out, depth=depth, env=env, show=False)
                if ": last step peak" not in line:
                    stopped = f"; depth {depth} did not: {line.split(': ', 1)[1][:160]}"
                    break
                largest = (depth, line.split(": ", 1)[1].split(";")[0])
            got = (f"depth {largest[0]} ({largest[0] * layer_mb:.0f} MB of weights, "
                   f"{largest[1]})" if largest else "nothing of --depths")
            print(f"{name}: trains {got}{stopped}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return 0


def run_one(name, args, out, depth=None, env=None, show=True):
    """Runs probe `name` in a child process (`depth`: its chain's, else `--depth`; `env`
    added to its environment); prints its line (`show`) and returns it."""
    before = set(glob.glob("/dev/shm/param_offload_*"))
    try:
        line = _child(name, args, out, depth or args.depth, env or {})
    finally:
        for leftover in set(glob.glob("/dev/shm/param_offload_*")) - before:
            shutil.rmtree(leftover, ignore_errors=True)
    if show:
        print(line)
    return line


def _child(name, args, out, depth, extra):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2",
               **extra)
    if name.endswith("+replicated") or name == "sink":
        env[REPLICATED + "PYFUNC"] = env[REPLICATED + "EAGERPYFUNC"] = "1"
    if name.endswith("write_file"):
        env[REPLICATED + "WRITEFILE"] = env[REPLICATED + "SERIALIZETENSOR"] = "1"
    try:
        proc = subprocess.run(
            [sys.executable, __file__, f"--probe={name}", f"--width={args.width}",
             f"--depth={depth}", f"--devices={args.devices}", f"--steps={args.steps}",
             f"--out={out}"] + (["--skip_reference"] if args.skip_reference else []),
            capture_output=True, text=True, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"{name}: no result in {TIMEOUT} s (the step never returned)"
    lines = [l for l in proc.stdout.splitlines() if l.startswith(name + ":")]
    died = "killed by signal %d" % -proc.returncode if proc.returncode < 0 else \
        "exit %d" % proc.returncode
    return "\n".join(lines) or f"{name}: {died} in the first step, nothing printed"


def make_readers(host, mesh, rows, name):
    """Per layer, a DTensor iterator whose device i reads piece i of the layer's weight
    from a host file (a NumPy memmap the host updates between steps: the list's `arrays`,
    one a layer), `[batch, unsharded]`, a fresh read at every `next`; the devices'
    iterators packed as DTensor packs its own (`tfpar.patches.per_device_iterator`)."""
    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, ROOT)
    from tfpar import patches

    directory = tempfile.mkdtemp(prefix="param_offload_", dir="/dev/shm")
    n, (width, _) = mesh.dim_size("batch"), host[0].shape
    piece = host[0].nbytes // n
    options = tf.data.Options()
    options.autotune.enabled = False  # nothing read ahead of its `next`
    options.experimental_optimization.inject_prefetch = False
    readers, arrays = [], []
    for k, w in enumerate(host):
        path = os.path.join(directory, f"w{k}")
        np.memmap(path, np.float32, "w+", shape=w.shape)[...] = w
        arrays.append(np.memmap(path, np.float32, "r+", shape=w.shape))
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
        readers.append(patches.per_device_iterator(
            iterators, tf.TensorSpec(w.shape, tf.float32), rows))

    class Readers(list):
        pass
    out = Readers(readers)
    out.directory, out.arrays = directory, arrays
    return out


def setup(args):
    """`args.devices` logical CPUs on a `batch` mesh; the chain's weights and batch."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    n, width, depth = args.devices, args.width, args.depth
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    mesh = dtensor.create_mesh([("batch", n)], devices=[f"CPU:{i}" for i in range(n)])
    rng = np.random.default_rng(0)
    host = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
            for _ in range(depth)]
    batch = rng.standard_normal((ROWS, width)).astype(np.float32)
    return mesh, host, batch


def run_probe(args):
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    if args.probe.startswith("train_"):
        return run_training(args)
    n, width, depth = args.devices, args.width, args.depth
    mesh, host, batch = setup(args)
    whole = dtensor.Layout.replicated(mesh, 2)
    rows = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)
    scalar = dtensor.Layout.replicated(mesh, 0)
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


def run_training(args):
    """One `train_*` probe: `args.steps` steps of the chain, Adam or momentum SGD (`LR`).
    `train_zero3_*`: pieces and slots as DVariables split over `batch`, the update in the
    step (Keras's formulas as TensorFlow ops, `_device_update`). `train_offload_*`: pieces
    in host files, each read by its device's reader in its layer, forward and backward
    (`_at_start`: all read at the step's start instead); the step's outputs are the
    pieces' summed gradients; the update runs on the host after the step (`tfpar.offload`'s
    `adam_step`/`momentum_step` on the files' arrays and NumPy slots), the next step reads
    the new pieces. Prints the allocator's resident before and peak during the last step,
    CPU seconds a step (steps 2 on), the weights against one device's Keras optimizer;
    writes the weights to `--out`."""
    import time

    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    sys.path.insert(0, ROOT)
    import keras
    from tfpar import offload

    name, depth = args.probe, args.depth
    adam, offloaded = "adam" in name, name.startswith("train_offload")
    mesh, host, batch = setup(args)
    whole = dtensor.Layout.replicated(mesh, 2)
    rows = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)
    scalar = dtensor.Layout.replicated(mesh, 0)
    names = ("momentum", "velocity") if adam else ("momentum",)
    readers = make_readers(host, mesh, rows, name) if offloaded else None
    current, starts, collected = [], [], {}

    def zero_of(t):  # 0.0 computed from `t`: what runs after it
        probe = tf.reduce_max(tf.reshape(t, [-1])[:1])
        return tf.where(probe == probe, 0.0, float("nan"))

    def piece_of(k, zero, handle):  # this device's piece of W_k, once `zero` exists
        if not offloaded:
            return handle + zero
        if starts:
            return starts[k] + zero
        with tf.control_dependencies([zero, handle]):
            piece = next(current[k])  # read from the host file now
        return piece + zero

    def layer(k):
        @tf.custom_gradient
        def run(h, handle):  # handle: the piece (zero3) or a 0.0 standing for it
            out = tf.tanh(tf.matmul(h, dtensor.relayout(piece_of(k, zero_of(h), handle),
                                                        whole)))

            def grad(dy):
                w = dtensor.relayout(piece_of(k, zero_of(dy), handle), whole)  # again
                with tf.GradientTape() as tape:
                    tape.watch([h, w])
                    again = tf.tanh(tf.matmul(h, w))
                dh, dw = tape.gradient(again, [h, w], output_gradients=dy)
                piece = dtensor.relayout(dw, rows)  # the reduce-scatter
                if offloaded:  # the piece's gradient: a step output
                    collected[k] = piece
                    return dh, tf.zeros([], tf.float32)
                return dh, piece
            return out, grad
        return run

    def forward_backward(x, handles):
        with tf.GradientTape() as tape:
            tape.watch(handles)
            h = x
            for k in range(depth):
                h = layer(k)(h, handles[k])
            loss = tf.reduce_mean(h * h)
        return loss, tape.gradient(loss, handles)

    if offloaded:
        host_slots = {s: [np.zeros_like(w) for w in host] for s in names}

        @tf.function
        def step(x, its):
            current[:] = its
            starts[:] = [next(it) for it in its] if name.endswith("at_start") else []
            handles = [dtensor.copy_to_mesh(tf.zeros([]), scalar) for _ in range(depth)]
            loss, _ = forward_backward(x, handles)
            return loss, [collected[k] for k in range(depth)]

        def train(x, scale, _):
            loss, grads = step(x, list(readers))
            for k, g in enumerate(grads):  # on the host, after the step
                g = np.concatenate([p.numpy() for p in dtensor.unpack(g)])
                w = readers.arrays[k]
                if adam:
                    w -= offload.adam_step(host_slots["momentum"][k],
                                           host_slots["velocity"][k], g, None, scale,
                                           BETA_1, BETA_2, EPSILON)
                else:
                    w += offload.momentum_step(host_slots["momentum"][k], g, scale,
                                               MOMENTUM, False)
                w.flush()
            return loss

        def weights():
            return [np.array(w) for w in readers.arrays]
    else:
        def split(value):
            return dtensor.DVariable(dtensor.relayout(
                dtensor.copy_to_mesh(tf.constant(value), whole), rows))
        pieces = [split(w) for w in host]
        slots = {s: [split(np.zeros_like(w)) for w in host] for s in names}

        @tf.function
        def step(x, scale):
            handles = [p.read_value() for p in pieces]
            now = {s: [v.read_value() for v in slots[s]] for s in names}
            loss, grads = forward_backward(x, handles)
            for k, g in enumerate(grads):  # written by layout, as tfpar.layout.step's
                new = _device_update(handles[k], g, {s: now[s][k] for s in names}, scale)
                for s in names:
                    slots[s][k].assign(dtensor.relayout(new[s], rows))
                pieces[k].assign(dtensor.relayout(new["weight"], rows))
            return loss

        def train(x, _, scale):
            return step(x, scale)

        def weights():
            return [np.concatenate([t.numpy() for t in dtensor.unpack(p.read_value())])
                    for p in pieces]

    x = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(batch), whole), rows)
    scales = [np.float32(LR)] * args.steps
    if adam:  # each step's alpha, Keras's formula as tfpar.offload computes it
        scales = [np.float32(LR * tf.sqrt(1 - tf.pow(tf.cast(BETA_2, tf.float32), t))
                             / (1 - tf.pow(tf.cast(BETA_1, tf.float32), t)))
                  for t in tf.range(1, args.steps + 1, dtype=tf.float32)]
    on_mesh = [dtensor.copy_to_mesh(tf.constant(s), scalar) for s in scales]
    try:
        with dtensor.default_mesh(mesh):
            for t in range(args.steps):
                if t == 1:
                    cpu = time.process_time()
                if t == args.steps - 1:
                    gc.collect()
                    tf.config.experimental.reset_memory_stats("CPU:0")
                    resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
                loss = float(dtensor.unpack(train(x, scales[t], on_mesh[t]))[0])
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            cpu = (time.process_time() - cpu) / max(args.steps - 1, 1)
            got = weights()
    except Exception as err:  # the probe's result is the error's first line
        print(f"{name}: FAILED {type(err).__name__}: {str(err).strip().splitlines()[0][:300]}")
        return 0
    worst = float("nan")
    if not args.skip_reference:  # one device, Keras's own optimizer (after the measuring)
        reference = [keras.Variable(w) for w in host]
        optimizer = (keras.optimizers.Adam(LR, BETA_1, BETA_2, EPSILON) if adam
                     else keras.optimizers.SGD(LR, momentum=MOMENTUM))
        for _ in range(args.steps):
            with tf.GradientTape() as tape:
                h = tf.constant(batch)
                for w in reference:
                    h = tf.tanh(tf.matmul(h, w.value))
                ref_loss = tf.reduce_mean(h * h)
            optimizer.apply(tape.gradient(ref_loss, [w.value for w in reference]), reference)
        worst = max(float(np.max(np.abs(g - w.numpy()))) for g, w in zip(got, reference))
    moved = max(float(np.max(np.abs(g - w))) for g, w in zip(got, host))
    np.savez(os.path.join(args.out, name + ".npz"), *got)

    def mb(b):
        return f"{b / 2 ** 20:.1f} MB"
    print(f"{name}: last step peak {mb(peak)}, of which {mb(resident)} resident before it "
          f"(weights {mb(depth * host[0].nbytes)}); {cpu:.2f} CPU s a step; after "
          f"{args.steps} steps loss {loss:.6g}, max |W - one device's Keras| {worst:.2e} "
          f"(the weights moved up to {moved:.2e})")
    if readers is not None:
        shutil.rmtree(readers.directory, ignore_errors=True)
    return 0


def _device_update(weight, grad, slots, scale):
    """Keras 3.15.1's Adam (slots momentum and velocity; `scale`: its alpha) or momentum
    SGD (`scale`: the learning rate) on one piece, as TensorFlow ops: the new weight
    and slots (`tfpar.offload.adam_step`/`momentum_step` on the host are the same
    float32 operations in the same order)."""
    import tensorflow as tf

    m = slots["momentum"]
    if "velocity" in slots:
        m = m + (grad - m) * (1 - BETA_1)
        v = slots["velocity"] + (tf.square(grad) - slots["velocity"]) * (1 - BETA_2)
        return {"weight": weight - (m * scale) / (tf.sqrt(v) + EPSILON),
                "momentum": m, "velocity": v}
    m = m * MOMENTUM - grad * scale
    return {"weight": weight + m, "momentum": m}


if __name__ == "__main__":
    sys.exit(main())
