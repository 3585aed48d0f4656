"""Child of tests/test_layout_keras.py, started by `python -m tfpar.launch --workers=2`:
each worker joins a DTensor mesh batch=2 × model=2 spanning both processes (2 logical CPUs
each) from its TF_CONFIG, trains 5 steps of a user MLP (SGD, then Adam), trains the
single-device reference on its own CPU and prints one JSON line with the differences.
"""

import json

from tfpar.layout import multi_client

cluster = multi_client.initialize(cpu_devices=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402
from tfpar import layout  # noqa: E402
from layout_keras_child import (LOSS, OPTIMIZERS, USER_LAYOUTS, arrays, diffs,  # noqa: E402
                                reference, seeded, sizes, task_for)

out = {"worker": cluster.worker_index, "runs": []}
mesh = multi_client.distributed_mesh(data_parallel=2, tensor_parallel=2)
out["mesh_devices"] = int(np.prod(mesh.shape))
task, build = task_for("mlp")
_, _, _, batches = arrays(task, "mlp", 8)
for opt_name in ("sgd", "adam"):
    with tf.device("/job:worker/replica:0/task:%d/device:CPU:0" % cluster.worker_index):
        ref, ref_losses, _ = reference(build, OPTIMIZERS[opt_name], batches)
    model, trainer = layout.build_on_mesh(mesh, list(USER_LAYOUTS["mlp"].items()),
                                          lambda: seeded(build), OPTIMIZERS[opt_name], LOSS)
    losses = [trainer.train_on_batch(*b)["loss"] for b in batches]
    out["runs"].append({"optimizer": opt_name, "diffs": diffs(model, ref), "losses": losses,
                        "ref_losses": ref_losses, **sizes(model, trainer.optimizer)})
print(json.dumps(out), flush=True)
# Worker 0 hosts the coordination service: no worker leaves before the others are done.
assert tfpar.wait_for_workers("end", 120)
