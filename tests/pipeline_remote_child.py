"""Child process for tests/test_pipeline_remote.py: `python tests/pipeline_remote_child.py
CHECK [WORKERS_JSON]`, printing one JSON line.

- `client WORKERS_JSON`: connects to the two `tfpar.pipeline.remote` workers at the
  addresses of WORKERS_JSON, trains a two-stage 1F1B pipeline (a stage per worker) 3 steps
  with SGD and with Adam next to a single-device model; per optimizer the largest weight
  difference and the tasks holding each stage's weights and optimizer slots.
- `refusals`: the trainer's settings a pipeline across `TF_CONFIG` workers cannot run,
  each refusal as `{"errors": ["ConfigError: ...", ...]}`.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mlp():
    import keras
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,))]
                            + [keras.layers.Dense(16, activation="tanh") for _ in range(4)]
                            + [keras.layers.Dense(3)])


def client(workers):
    from tfpar.pipeline import remote
    devices = remote.connect(workers)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfpar.pipeline.model import PipelineModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    out = {}
    for name, make in (("sgd", lambda: keras.optimizers.SGD(0.1)),
                       ("adam", lambda: keras.optimizers.Adam(0.01))):
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            ref = mlp()
            ref.compile(optimizer=make(), loss="mse", jit_compile=False)
        pm = PipelineModel.split(mlp(), 2, "1f1b", microbatches=4, devices=devices)
        pm.compile(optimizer=make(), loss="mse")
        for _ in range(3):
            ref.train_on_batch(x, y)
            pm.train_on_batch(x, y)
        out[name] = float(max(np.abs(a - b).max()
                              for a, b in zip(pm.get_weights(), ref.get_weights())))
        task = lambda v: v.value.device.split("/device")[0]
        out[name + "_devices"] = [sorted({task(v) for v in s.weights}) for s in pm.stages]
        out[name + "_slots"] = [sorted({task(v) for v in o.variables})
                                for o in pm.stage_optimizers]
    return out


def refusals():
    from tfpar import ParallelConfig, tf_config
    from tfpar.backends.distribute import DistributeBackend
    env = {"TF_CONFIG": tf_config.make(["localhost:1", "localhost:2"], 1)}
    errors = []
    for changes in ({"data_parallel": 2}, {"pipeline_stages": 3, "microbatches": 2}):
        try:
            DistributeBackend().build_runtime(ParallelConfig(
                pipeline_stages=2, microbatches=4, global_batch_size=16).replace(**changes), env)
        except Exception as err:
            errors.append(type(err).__name__ + ": " + str(err))
    return {"errors": errors}


if __name__ == "__main__":
    if sys.argv[1] == "client":
        print(json.dumps(client(json.loads(sys.argv[2]))))
    elif sys.argv[1] == "refusals":
        print(json.dumps(refusals()))
    else:
        sys.exit(f"pipeline_remote_child.py: unknown check {sys.argv[1]!r} (client or refusals)")
