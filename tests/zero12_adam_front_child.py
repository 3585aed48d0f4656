"""Child process for tests/test_zero12_adam_front.py: `python tests/zero12_adam_front_child.py`,
on 2 logical CPUs under a `MirroredStrategy`; prints one JSON line mapping each codec to its
result.

ZeRO-2 with Adam in front of lowbit and top-k (`--adam_warmup_steps=1`, so the second step
compresses) under `--on_nan=skip_step`, the mlp in fp32, built as the trainer builds it:
two steps, a step whose batch holds one infinite input (replica 0's half), one more step.
Recorded around the bad step: how far the weights and the codec's per-replica state (every
replica's residuals and moments, the step counter) moved, the optimizer's count of skipped
steps, and how far they moved on the next step.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig, backends, data, devices  # noqa: E402
from zero12_codecs_child import _codec_state  # noqa: E402
from zero_fp16_child import _largest, _moved  # noqa: E402


def _state(model, strategy):
    from tfpar.zero import sharded
    zero = sharded.zero_of(model.optimizer)
    return {"weights": [np.asarray(w.numpy()) for w in model.weights],
            "codec": _codec_state(zero, strategy),
            "skipped": float(zero.nonfinite_steps.numpy())}


def run_case(codec, runtime, backend):
    config = ParallelConfig(strategy="mirrored", cpu_devices=2, model="mlp", optimizer="adam",
                            learning_rate=1e-3, global_batch_size=32, zero_stage=2,
                            compression=codec, adam_warmup_steps=1, on_nan="skip_step")
    task = data.make_task(config)
    strategy = runtime.strategy
    batches = data.global_batches(config, task, 0, 4)
    model = backend.build_model(config, runtime, task)
    for i in range(2):
        model.train_on_batch(*batches[i])
    before = _state(model, strategy)
    x, y = batches[2]
    x = x.copy()
    x[0, 0] = np.inf  # the first example: replica 0's half of the batch
    model.train_on_batch(x, y)
    after = _state(model, strategy)
    model.train_on_batch(*batches[3])
    following = _state(model, strategy)
    return {"codec_arrays": len(before["codec"]), "codec_largest": _largest(before["codec"]),
            "weights_moved": _moved(before["weights"], after["weights"]),
            "codec_moved": _moved(before["codec"], after["codec"]),
            "skipped": [before["skipped"], after["skipped"], following["skipped"]],
            "weights_moved_next": _moved(after["weights"], following["weights"]),
            "codec_moved_next": _moved(after["codec"], following["codec"]),
            "weights_finite": bool(all(np.isfinite(w).all() for w in following["weights"]))}


def main():
    devices.split_cpu(2)
    first = ParallelConfig(strategy="mirrored", cpu_devices=2)
    backend = backends.for_config(first)
    runtime = backend.build_runtime(first)
    print(json.dumps({codec: run_case(codec, runtime, backend)
                      for codec in ("lowbit", "topk")}), flush=True)


if __name__ == "__main__":
    main()
