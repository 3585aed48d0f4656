"""Child of tests/test_guides.py: `examples/guides/multi_worker_tutorial.py`
(tensorflow.org's "Multi-worker training with Keras", step by step).

Usage: python tests/guides_tutorial_child.py {worker|single} OUT.npz

`worker`: one worker of the tutorial's cluster (its `TF_CONFIG` set by the test): the
script's `main()`, as `python multi_worker_tutorial.py` runs it. `single`: what the
tutorial trains first, on one worker without a strategy: the same seed, data and model at
the global batch of two workers, the same epochs and steps. Both save the weights after
`fit` to OUT.npz and print one JSON line with the `History`.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples", "guides"))
WORKERS = 2

mode, out_path = sys.argv[1], sys.argv[2]

import keras  # noqa: E402
import multi_worker_tutorial as tutorial  # noqa: E402

if mode == "worker":
    model = tutorial.main()
    worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
else:
    keras.utils.set_random_seed(tutorial.SEED)
    batches = tutorial.training_batches(tutorial.BATCH_PER_WORKER * WORKERS)
    model = tutorial.convnet()
    model.fit(batches, epochs=tutorial.EPOCHS, steps_per_epoch=tutorial.STEPS_PER_EPOCH)
    worker = None
np.savez(out_path, **{v.path: v.numpy() for v in model.weights})
print(json.dumps({"mode": mode, "worker": worker, "history": model.history.history,
                  "replicas": model.distribute_strategy.num_replicas_in_sync}), flush=True)
