"""Child process for tests/test_zero12_codecs.py: `python tests/zero12_codecs_child.py`, on
2 logical CPUs under a `MirroredStrategy`; prints one JSON line mapping each case to its
result.

Each case is ZeRO stage 2 with one of the codecs lifted for stages 1-2 (lowbit and top-k
reduce-scatters with ZeRO's own residual; threshold and PowerSGD through their aggregator,
residuals and Q in it; lowbit, top-k and PowerSGD with Adam in front, each replica's
moments and the step counter in the aggregator), the mlp with Adam under `mixed_float16`, built as the trainer
builds it: as tests/zero_fp16_child.py (whose helpers it calls), two steps, a step whose
batch holds one infinite input on replica 0, one more step; how far the weights, the slot
pieces and the codec's per-replica state (every replica's residuals, PowerSGD's Q) moved
around the overflowing step; saved with `tfpar.state` and loaded into a second model, the
largest difference of that state and of the weights after one more step from each.

Then the collective ops of the step `fit` traced for ZeRO-2 with PowerSGD (Adam behind it,
and in front) and for data parallelism with PowerSGD (fp32, `tests/dp_overhead_child.py`'s
count): ZeRO's gradient finiteness, decided by one scalar all-reduce before the aggregator
runs, needs no other; with Adam in front ZeRO runs data parallelism's collectives.
Prints `{"skips": {codec: result}, "collectives": {run: {op: count}}}`.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig, backends, devices  # noqa: E402
from zero_fp16_child import _largest, _moved, overflow_and_resume  # noqa: E402

# Adam behind each codec (`--nocompress_adam_step`; threshold has no Adam in front), and
# in front of lowbit, top-k and PowerSGD (the default with Adam) past a one-step warm-up,
# so residuals and moments hold something when the overflow comes.
CASES = {codec: {"zero_stage": 2, "compression": codec, "topk_union": False,
                 "compress_adam_step": False}
         for codec in ("lowbit", "topk", "threshold", "powersgd")}
CASES.update({f"{codec}-front": {"zero_stage": 2, "compression": codec, "adam_warmup_steps": 1}
              for codec in ("lowbit", "topk", "powersgd")})


def _codec_state(zero, strategy):
    """Every replica's residual (ZeRO's, or the aggregator's), PowerSGD's Qs, and with Adam
    in front every replica's moments and the step counter."""
    local = strategy.experimental_local_results
    layout = zero._tfpar_layout
    variables = [layout.residual] if layout.residual is not None else []
    if layout.aggregator is not None:
        variables += list(layout.aggregator.residuals.values())
        variables += list(getattr(layout.aggregator, "qs", {}).values())
        if layout.front:
            variables += list(layout.aggregator.moments.values()) + [layout.aggregator.step]
    return [np.asarray(p) for v in variables for p in local(v)]


def _state(model, strategy):
    from tfpar.zero import sharded
    opt = model.optimizer
    zero = sharded.zero_of(opt)
    local = strategy.experimental_local_results
    return {"weights": [np.asarray(w.numpy()) for w in model.weights],
            "slots": [np.asarray(p) for v in zero._tfpar_layout.slots.values()
                      for p in local(v)],
            "codec": _codec_state(zero, strategy),
            "scale": float(opt.dynamic_scale.numpy()),
            "iterations": int(opt.iterations.numpy())}


def run_case(settings, runtime, backend):
    losses, skipped_loss, before, after, loaded, next_state, other_weights = \
        overflow_and_resume(settings, runtime, backend, _state)
    return {
        "losses": losses, "skipped_loss": skipped_loss,
        "codec_arrays": len(before["codec"]), "codec_largest": _largest(before["codec"]),
        "slots_largest": _largest(before["slots"]),
        "weights_moved": _moved(before["weights"], after["weights"]),
        "slots_moved": _moved(before["slots"], after["slots"]),
        "codec_moved": _moved(before["codec"], after["codec"]),
        "scales": [before["scale"], after["scale"]],
        "iterations": [before["iterations"], after["iterations"]],
        "weights_moved_next": _moved(after["weights"], next_state["weights"]),
        "codec_moved_next": _moved(after["codec"], next_state["codec"]),
        "loaded_diff": max(_moved(after[k], loaded[k]) for k in ("weights", "slots", "codec")),
        "loaded_scale": loaded["scale"],
        "resumed_next_diff": _moved(next_state["weights"], other_weights),
    }


def collectives(runtime):
    """`{run: {collective op: count}}` of ZeRO-2's PowerSGD step with Adam behind it
    (`zero2`) and in front (`zero2-front`, the default), and data parallelism's (Adam in
    front)."""
    import keras

    from dp_overhead_child import op_types
    from tfpar.train import train
    out = {}
    for name, extra in (("zero2", {"zero_stage": 2, "compress_adam_step": False}),
                        ("zero2-front", {"zero_stage": 2}), ("dp", {})):
        keras.mixed_precision.set_global_policy("float32")
        config = ParallelConfig(strategy="mirrored", cpu_devices=2, model="mlp",
                                model_width=64, global_batch_size=32, steps=2,
                                steps_per_epoch=2, verbose=0, compression="powersgd",
                                **extra)
        _, model = train(config, runtime=runtime)
        out[name] = {op: n for op, n in op_types(model).items() if op.startswith("Collective")}
    return out


def main():
    devices.split_cpu(2)
    first = ParallelConfig(strategy="mirrored", cpu_devices=2, mixed_precision="fp16")
    backend = backends.for_config(first)
    runtime = backend.build_runtime(first)
    skips = {name: run_case(settings, runtime, backend) for name, settings in CASES.items()}
    print(json.dumps({"skips": skips, "collectives": collectives(runtime)}), flush=True)


if __name__ == "__main__":
    main()
