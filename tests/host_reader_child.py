"""Child of tests/test_patches.py (`tfpar.patches.per_device_iterator`), on 2 logical CPUs
(a DTensor mesh `batch` = 2): a 4 x 3 float32 array in a host file (a NumPy memmap), each
device reading its own 2 rows by a `tf.data` reader of its own, the readers packed into one
iterator. A DTensor function reads it twice in one call; the host then rewrites the file in
place and the function runs again. Prints one JSON line: `calls` (each call's two reads,
whole), `expected` (the file's contents at each call), `layout` and `expected_layout`.
With `tf.data`'s default options (autotune, injected prefetch) the second call returned
the file's old contents (TF 2.21): the readers here read nothing ahead.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def readers(path, mesh, layout, shape):
    """One iterator over `path`: device i's element is the file's i-th block of rows."""
    from tfpar import patches
    n = len(mesh.local_devices())
    piece = 4 * int(np.prod(shape)) // n
    options = tf.data.Options()
    options.autotune.enabled = False  # nothing read ahead of a `next`
    options.experimental_optimization.inject_prefetch = False
    iterators = []
    for i, device in enumerate(mesh.local_devices()):
        with tf.device(device):
            ds = tf.data.FixedLengthRecordDataset(path, piece, header_bytes=i * piece,
                                                  footer_bytes=(n - 1 - i) * piece)
            ds = ds.repeat().map(lambda b: tf.reshape(tf.io.decode_raw(b, tf.float32),
                                                      (shape[0] // n, shape[1])))
            iterators.append(iter(ds.with_options(options)))
    return patches.per_device_iterator(iterators, tf.TensorSpec(shape, tf.float32), layout)


def main():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(2)])
    from tensorflow.experimental import dtensor
    mesh = dtensor.create_mesh([("batch", 2)], devices=["CPU:0", "CPU:1"])
    rows = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)
    shape = (4, 3)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "weight")
        array = np.memmap(path, np.float32, "w+", shape=shape)
        array[...] = np.arange(12, dtype=np.float32).reshape(shape)
        array.flush()
        reader = readers(path, mesh, rows, shape)

        @tf.function
        def step(it):
            first = next(it)
            with tf.control_dependencies([first]):
                second = next(it)
            return first, second

        calls, expected, layout = [], [], None
        with dtensor.default_mesh(mesh):
            for _ in range(2):
                expected.append(np.array(array).tolist())
                out = step(reader)
                layout = dtensor.fetch_layout(out[0]).to_string()
                calls.append([np.concatenate([p.numpy() for p in dtensor.unpack(t)]).tolist()
                              for t in out])
                array += 100.0  # the host's update between steps, in place
                array.flush()
    print(json.dumps({"calls": calls, "expected": expected, "layout": layout,
                      "expected_layout": rows.to_string()}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
