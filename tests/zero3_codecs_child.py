"""Child process for tests/test_zero3_codecs.py: `python tests/zero3_codecs_child.py
CASE[,CASE...]`, on 2 logical CPUs (a ZeRO-3 mesh, `batch` = 2); prints one JSON line
mapping each case to its result.

- `fp16_skip`: the mlp with momentum under `mixed_float16`, `--zero_stage=3
  --compression=int8`, built as the trainer builds it: two steps, then a step whose batch
  holds one infinite input (the first example: replica 0's half of the batch only), then
  one more step. Recorded around the overflowing step: how far the weights (their pieces)
  and the codec's residuals moved, the loss scale and the step count.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import cases  # noqa: E402
import graph_optimizer  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import ParallelConfig, backends, data  # noqa: E402

BATCH = 32
CONFIG = {"cpu_devices": 2, "zero_stage": 3, "model": "mlp", "optimizer": "momentum",
          "learning_rate": 0.05, "mixed_precision": "fp16", "global_batch_size": BATCH}


def _moved(a, b):
    return max([float(np.max(np.abs(x - y))) for x, y in zip(a, b)], default=0.0)


def _largest(arrays):
    return max([float(np.max(np.abs(x))) for x in arrays], default=0.0)


def fp16_skip():
    from tfpar.layout.values import to_host
    config = ParallelConfig(**CONFIG, compression="int8")
    backend = backends.for_config(config)
    runtime = backend.build_runtime(config)
    task = data.make_task(config)
    model = backend.build_model(config, runtime, task)
    trainer = backend.trainer
    opt = trainer.optimizer

    def state():
        return {"weights": [to_host(w.value) for w in model.weights],
                "residuals": [to_host(r) for r in trainer.reduction.variables],
                "scale": float(to_host(opt.dynamic_scale.value)),
                "iterations": int(to_host(opt.iterations.value))}

    batches = data.global_batches(config, task, 0, 4)
    losses = [trainer.train_on_batch(*batches[i])["loss"] for i in range(2)]
    before = state()
    x, y = batches[2]
    x = x.copy()
    x[0, 0] = np.inf  # the first example: replica 0's half of the batch
    skipped = trainer.train_on_batch(x, y)["loss"]
    after = state()
    losses.append(trainer.train_on_batch(*batches[3])["loss"])
    last = state()
    return {"codec": type(trainer.reduction).__name__, "losses": losses,
            "skipped_loss": skipped, "residuals": len(before["residuals"]),
            "residual_largest": _largest(before["residuals"]),
            "weights_moved": _moved(before["weights"], after["weights"]),
            "residual_moved": _moved(before["residuals"], after["residuals"]),
            "scales": [before["scale"], after["scale"]],
            "iterations": [before["iterations"], after["iterations"], last["iterations"]],
            "weights_moved_next": _moved(after["weights"], last["weights"]),
            "residual_moved_next": _moved(after["residuals"], last["residuals"])}


CASES = {"fp16_skip": fp16_skip}

if __name__ == "__main__":
    graph_optimizer.apply()  # the test's choice (tests/graph_optimizer.py)
    out = cases.run_cases(CASES, sys.argv[1].split(","))
    out["grappler"] = graph_optimizer.setting()  # what the cases ran with
    print(json.dumps(out), flush=True)
