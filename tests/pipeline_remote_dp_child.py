"""Child process for tests/test_pipeline_remote_dp.py: one worker of a two-worker
`TF_CONFIG` cluster on localhost (`python tests/pipeline_remote_dp_child.py`), printing one
JSON line.

Both workers build the trainer's runtime for a pipeline across workers with 2 replicas
(`--pipeline_stages=2 --cpu_devices=2`): worker 1 serves stage 1 of both replicas on its
two logical CPUs and prints `{"served": true}` once worker 0 has gone; worker 0 is the
client. On it each case of `CASES` builds the trainer's `PipelineModel` and optimizer
(aggregator included) for its settings, trains `STEPS` steps of one fixed batch, and
reports, per case:

- `gap_one_device`: the largest weight difference from the same model and optimizer
  trained on one device (the chief's CPU:0) on the same batches,
- `losses`: the per-step loss, `comm`: the metrics JSON's `comm` block,
- `replica_gap`: the largest difference between a stage weight's two replica copies,
- `devices`, `slots`: per stage, the devices of its weights and of its optimizer's
  variables (aggregator state included),
- `seconds`: the case's wall time (building and tracing included).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 4
BASE = dict(pipeline_stages=2, microbatches=2, cpu_devices=2, global_batch_size=16,
            optimizer="sgd", learning_rate=0.1)
# name -> settings on top of BASE. PowerSGD at rank 2 (at full rank it would send these
# 16 x 16 matrices whole) and top-k keeping a quarter of every tensor (none sent dense):
# both carry what they leave out in error feedback.
CASES = {
    "sgd": {},
    "adam": {"optimizer": "adam", "learning_rate": 0.01},
    "fp16": {"compression": "fp16"},
    "int8": {"compression": "int8"},
    "powersgd": {"compression": "powersgd", "powersgd_rank": 2},
    "topk": {"compression": "topk", "topk_ratio": 0.25, "topk_dense_below": 0},
}


def mlp():
    import keras
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,))]
                            + [keras.layers.Dense(16, activation="tanh") for _ in range(4)]
                            + [keras.layers.Dense(3)])


def run_case(runtime, config, x, y):
    import numpy as np
    import tensorflow as tf

    from tfpar import metrics, optimizers, pipeline

    with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
        ref = mlp()
        ref.compile(optimizer=optimizers.plain_optimizer(config), loss="mse",
                    jit_compile=False)
    with runtime.strategy.scope():
        pm = pipeline.for_training(mlp(), config, runtime)
        pm.compile(optimizer=optimizers.make_optimizer(config), loss="mse",
                   jit_compile=False)
    losses = []
    for _ in range(STEPS):
        ref.train_on_batch(x, y)
        losses.append(float(pm.train_on_batch(x, y)))
    task = lambda t: t.device.replace("/device:", "/")  # noqa: E731
    copies = lambda v: getattr(v.value, "values", (v.value,))  # noqa: E731 - Keras's variable
    return {
        "gap_one_device": float(max(np.abs(a - b).max()
                                    for a, b in zip(pm.get_weights(), ref.get_weights()))),
        "losses": losses,
        "comm": metrics.comm_stats(pm, runtime.replicas),
        "replica_gap": float(max(np.abs(c.numpy() - copies(v)[0].numpy()).max()
                                 for s in pm.stages for v in s.weights for c in copies(v))),
        "devices": [sorted({task(c) for v in s.weights for c in copies(v)})
                    for s in pm.stages],
        "slots": [sorted({task(c) for v in o.variables for c in copies(v)})
                  for o in pm.stage_optimizers],
    }


def timed(fn, *args):
    import time
    start = time.perf_counter()
    out = fn(*args)
    return {**out, "seconds": round(time.perf_counter() - start, 1)}


def main():
    from tfpar import ParallelConfig
    from tfpar.backends.distribute import DistributeBackend

    base = ParallelConfig(**BASE)
    try:
        runtime = DistributeBackend().build_runtime(base)
    except SystemExit as done:  # a non-chief worker: served until the chief left
        return {"served": done.code in (0, None)}
    import numpy as np

    from cases import run_cases
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    cases = {name: (lambda s=settings: timed(run_case, runtime, base.replace(**s), x, y))
             for name, settings in CASES.items()}
    out = run_cases(cases, list(CASES))
    out["replicas"] = runtime.replicas
    out["strategy"] = type(runtime.strategy).__name__
    return out


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
