"""Child process for tests: `python tests/checkpoint_snapshot_child.py DIR`.

On 2 logical CPUs, a `tf.train.Checkpoint` of a DVariable split over a 1×2 mesh and a
plain variable is snapshotted (`tfpar.patches.checkpoint_snapshot` with the mesh's
`to_host`), both variables are then changed, and the snapshot is written from another
thread while this one runs a collective on the mesh. Prints one JSON line: whether any
snapshot value is still a DTensor, the written values, the data files written.
"""

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar import devices  # noqa: E402


def main():
    directory = sys.argv[1]
    devices.split_cpu(2)
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    from tfpar import patches
    from tfpar.layout import values
    from tfpar.layout.mesh import make_mesh
    mesh = make_mesh(1, 2).backend_mesh
    split = dtensor.Layout([dtensor.UNSHARDED, "model"], mesh)
    start = np.arange(8, dtype=np.float32).reshape(2, 4)
    on_mesh = dtensor.DVariable(values.to_mesh(start, split))
    plain = tf.Variable(3.0)
    checkpoint = tf.train.Checkpoint(on_mesh=on_mesh, plain=plain)
    snapshot = patches.checkpoint_snapshot(checkpoint, {}, to_host=values.to_host)
    tensors = [spec.tensor if hasattr(spec, "slice_spec") else spec
               for saved in snapshot.values() for spec in saved.values()]
    still_on_mesh = [dtensor.is_dtensor(t) for t in tensors if isinstance(t, tf.Tensor)]
    on_mesh.assign(values.to_mesh(-start, split))
    plain.assign(-1.0)
    prefix = os.path.join(directory, "ckpt-1")
    writer = threading.Thread(target=patches.write_checkpoint, args=(snapshot, prefix))
    writer.start()
    for _ in range(20):  # the mesh's collectives meanwhile (a gather of the split value)
        gathered = values.to_host(on_mesh)
    writer.join()
    reader = tf.train.load_checkpoint(prefix)
    print(json.dumps({
        "any_dtensor": any(still_on_mesh),
        "on_mesh": reader.get_tensor("on_mesh/.ATTRIBUTES/VARIABLE_VALUE").tolist(),
        "plain": float(reader.get_tensor("plain/.ATTRIBUTES/VARIABLE_VALUE")),
        "gathered": gathered.tolist(),
        "files": sorted(os.listdir(directory))}), flush=True)


if __name__ == "__main__":
    main()
