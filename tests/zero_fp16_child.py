"""Child process for tests/test_zero_fp16.py: `python tests/zero_fp16_child.py`, on 2
logical CPUs under a `MirroredStrategy`; prints one JSON line mapping each case to its
result.

Each case (ZeRO stage 1 uncompressed, ZeRO stage 2 with the int8 reduce-scatter and its
error feedback; the mlp with Adam under `mixed_float16`, built as the trainer builds it;
and ZeRO-2 int8 in float32 with `--on_nan=skip_step`, where ZeRO's own check skips the
step) trains two steps, then a step whose batch holds one infinite input (the first
example: replica 0's half of the batch only; the float32 case one on each replica), then
one more step. Recorded around the overflowing step: how far the weights, each replica's
pieces of the sharded slots and its residual moved, the loss scale, the step count and
ZeRO's count of skipped steps (`nonfinite_steps`). After the skipped step the state is
saved with `tfpar.state` (as the trainer's checkpoints save it) and loaded into a second
model built the same way: the largest difference of its weights, slots, residual and loss
scale, and of the weights after one more step on the same batch from each.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig, backends, data, devices, optimizers, state  # noqa: E402

BATCH = 32
# name: (settings, the examples made infinite in the overflowing step's batch)
CASES = {"z1": ({"zero_stage": 1}, [0]),
         "z2-int8": ({"zero_stage": 2, "compression": "int8"}, [0]),
         # float32, the step skipped by ZeRO's own finiteness check (`--on_nan=skip_step`),
         # an infinite input on each replica: each finds its own gradient non-finite, on
         # any CPU (how far a NaN travels through ReLU depends on the CPU).
         "z2-int8-fp32-skip": ({"zero_stage": 2, "compression": "int8",
                                "mixed_precision": "none", "on_nan": "skip_step"},
                               [0, BATCH // 2])}


def _state(model, strategy):
    """Host copies: weights, every replica's slot pieces, every replica's residual, scale
    (None without fp16), step count, ZeRO's count of skipped steps (replica 0's)."""
    from tfpar.zero import sharded
    opt = model.optimizer
    zero = sharded.zero_of(opt)
    local = strategy.experimental_local_results
    slots = [np.asarray(p) for v in zero._tfpar_layout.slots.values() for p in local(v)]
    residual = zero._tfpar_layout.residual
    return {"weights": [np.asarray(w.numpy()) for w in model.weights],
            "slots": slots,
            "residual": [np.asarray(p) for p in local(residual)] if residual is not None else [],
            "scale": (float(opt.dynamic_scale.numpy()) if hasattr(opt, "dynamic_scale")
                      else None),
            "iterations": int(opt.iterations.numpy()),
            "nonfinite_steps": float(local(zero.nonfinite_steps.value)[0].numpy())}


def _moved(a, b):
    return max([float(np.max(np.abs(x - y))) for x, y in zip(a, b)], default=0.0)


def _largest(arrays):
    return max([float(np.max(np.abs(x))) for x in arrays], default=0.0)


def overflow_and_resume(settings, runtime, backend, state_of, infinite=(0,)):
    """Two steps, a third whose examples `infinite` (default the first: replica 0's) have
    an infinite input (skipped), the state saved and loaded into a second model as the
    trainer's checkpoints do (tfpar.state names + aggregators), then one more step on
    both. `state_of(model, strategy)` reads the state compared. Returns (losses, skipped loss, states before / after the skip, loaded, after
    the next step, the loaded model's weights after its next step)."""
    config = ParallelConfig(**{"strategy": "mirrored", "cpu_devices": 2, "model": "mlp",
                               "optimizer": "adam", "learning_rate": 1e-3,
                               "mixed_precision": "fp16", "global_batch_size": BATCH,
                               **settings})
    optimizers.set_policy(config.mixed_precision)  # float32 again after an fp16 case
    task = data.make_task(config)
    strategy = runtime.strategy
    batches = data.global_batches(config, task, 0, 4)
    model = backend.build_model(config, runtime, task)
    losses = [float(model.train_on_batch(*batches[i])[0]) for i in range(2)]
    before = state_of(model, strategy)
    x, y = batches[2]
    x = x.copy()
    x[list(infinite), 0] = np.inf  # example 0: replica 0's half of the batch
    skipped_loss = float(model.train_on_batch(x, y)[0])
    after = state_of(model, strategy)

    path = tf_checkpoint_write(model)
    other = backend.build_model(config, runtime, task)
    state.load(path, state.LayoutState(other), state.aggregators_of(other))
    loaded = state_of(other, strategy)

    losses.append(float(model.train_on_batch(*batches[3])[0]))
    next_state = state_of(model, strategy)
    other.train_on_batch(*batches[3])
    return (losses, skipped_loss, before, after, loaded, next_state,
            [w.numpy() for w in other.weights])


def run_case(settings, infinite, runtime, backend):
    losses, skipped_loss, before, after, loaded, next_state, other_weights = \
        overflow_and_resume(settings, runtime, backend, _state, infinite)
    return {
        "losses": losses, "skipped_loss": skipped_loss,
        "slot_pieces": len(before["slots"]), "residuals": len(before["residual"]),
        "slots_largest": _largest(before["slots"]),
        "residual_largest": _largest(before["residual"]),
        "weights_moved": _moved(before["weights"], after["weights"]),
        "slots_moved": _moved(before["slots"], after["slots"]),
        "residual_moved": _moved(before["residual"], after["residual"]),
        "scales": [before["scale"], after["scale"]],
        "iterations": [before["iterations"], after["iterations"]],
        "nonfinite_steps": [before["nonfinite_steps"], after["nonfinite_steps"]],
        "weights_moved_next": _moved(after["weights"], next_state["weights"]),
        "slots_moved_next": _moved(after["slots"], next_state["slots"]),
        "residual_moved_next": _moved(after["residual"], next_state["residual"]),
        "loaded_diff": max(_moved(after[k], loaded[k]) for k in ("weights", "slots", "residual")),
        "loaded_scale": loaded["scale"], "loaded_iterations": loaded["iterations"],
        "loaded_nonfinite_steps": loaded["nonfinite_steps"],
        "resumed_next_diff": _moved(next_state["weights"], other_weights),
    }


def tf_checkpoint_write(model):
    import tensorflow as tf
    return tf.train.Checkpoint(state=state.LayoutState(model),
                               **state.aggregators_of(model)).save(
        os.path.join(tempfile.mkdtemp(), "ckpt"))


def main():
    devices.split_cpu(2)
    first = ParallelConfig(strategy="mirrored", cpu_devices=2, mixed_precision="fp16")
    backend = backends.for_config(first)
    runtime = backend.build_runtime(first)
    out = {name: run_case(*case, runtime, backend) for name, case in CASES.items()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
