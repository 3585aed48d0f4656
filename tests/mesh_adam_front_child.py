"""Child process for tests/test_mesh_adam_front.py:
`python tests/mesh_adam_front_child.py RUNS_JSON OUT_PREFIX` or `... mesh_steps`.

- RUNS_JSON: `tests/reshard_child.py`'s runs (its docstring: what each run records, the
  final state saved as `OUT_PREFIX_<name>.npz` under `tfpar.state`'s names), each result
  also with its `comm` (the codec's bytes per step) when it has one.
- `mesh_steps`: a user's mlp on a 2×2 mesh, built by `tfpar.layout.build_on_mesh`; prints
  one JSON line of two results:
  - `warm_collectives`: lowbit with Adam in front, each replica keeping its own `v` (the
    default: the state keeps rows, and the warm-up whole copies) and with `v` frozen (the
    moments whole), under TensorFlow's profiler: a warm-up step's collective ops on the
    4 devices, by type (the trainer's second step; which moments are rows, `comm_stats`
    after it, how many copies), the next warm-up step's after a save (what a checkpoint
    reads), and a compressed step's variable reads and writes (`warm_collectives`);
  - `fp16_skip`: under `mixed_float16`, Keras's `LossScaleOptimizer` over Adam, top-k with
    Adam in front (one exact step): two steps, a step whose batch holds one infinite input
    (replica 0's part), one more step; how far the codec's state (residuals, Adam's
    moments, the counter), the weights and the loss scale moved around the overflowing
    step.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reshard_child  # noqa: E402


def with_comm():
    """`tfpar.train.train` noting each run's `comm`; printed after reshard_child's line."""
    import importlib
    train_lib = importlib.import_module("tfpar.train")
    train, comms = train_lib.train, []

    def noted(config, **kwargs):
        result, model = train(config, **kwargs)
        comms.append(result.get("comm"))
        return result, model
    train_lib.train = noted
    return comms


def _mlp_on_mesh(make_optimizer, compression, codec_options):
    """`(model, trainer, batches)`: the user's mlp (seeded) on a 2×2 mesh."""
    from layout_keras_child import LOSS, USER_LAYOUTS, arrays, seeded, task_for
    from tfpar import layout

    task, build = task_for("mlp")
    *_, batches = arrays(task, "mlp", 32, steps=4)
    model, trainer = layout.build_on_mesh(
        layout.make_mesh(2, 2), list(USER_LAYOUTS["mlp"].items()), lambda: seeded(build),
        make_optimizer, LOSS, compression=compression, codec_options=codec_options)
    return model, trainer, batches


def _profiled_kinds(trainer, batch):
    """The op types of one `trainer` step on `batch`, under TensorFlow's profiler."""
    import tensorflow as tf
    from tfpar import profiling
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        trainer.train_on_batch(*batch[:2])
        tf.profiler.experimental.stop()
        return [profiling.op_type(n) for n, _, _ in profiling.read_events(logdir)]


def _count(kinds, prefix):
    return {k: kinds.count(k) for k in set(kinds) if k and k.startswith(prefix)}


# Variable reads and writes as the profiler names their ops.
_VARIABLE_OPS = ("ReadVariableOp", "AssignVariableOp")


def warm_collectives():
    """Per variant of `v` (each replica's own: rows and their warm-up copies; frozen:
    whole), a trainer with a 3-step warm-up: its second step's collectives (a warm-up
    step), with `v` its own also its third's after a save; its fifth step's variable reads
    and writes (compressed, past the first compressed step, which converts the momentum)."""
    import keras
    from tfpar import state

    out = {}
    for name, variance in (("own_v", None), ("frozen_v", "frozen")):
        options = {"adam_front": True, "adam_warmup_steps": 3, "adam_variance": variance}
        model, trainer, batches = _mlp_on_mesh(lambda: keras.optimizers.Adam(1e-3), "lowbit",
                                               options)
        trainer.train_on_batch(*batches[0][:2])  # traced and compiled
        kinds = _profiled_kinds(trainer, batches[1])
        out[name] = {"collectives": _count(kinds, "Collective"),
                     "rows": [trainer.reduction.m_rows, trainer.reduction.v_rows],
                     "comm": trainer.reduction.comm_stats(),
                     "copies": len(trainer.reduction.m_warm) + len(trainer.reduction.v_warm)}
        # What a checkpoint's save reads (`LayoutState._serialize_to_tensors`), then the
        # last warm-up step.
        for read, _, _ in state.LayoutState(model).entries().values():
            read()
        kinds = _profiled_kinds(trainer, batches[2])
        out[name]["collectives_after_save"] = _count(kinds, "Collective")
        trainer.train_on_batch(*batches[3][:2])  # the first compressed step
        kinds = _profiled_kinds(trainer, batches[0])
        out[name]["variable_ops"] = {k: kinds.count(k) for k in _VARIABLE_OPS}
    return out


def fp16_skip():
    import keras
    import numpy as np
    from tfpar import layout

    def host(variables):
        return [np.asarray(layout.to_host(v.value if hasattr(v, "path") else v), "float64")
                for v in variables]

    def moved(before, after):
        return max(float(np.max(np.abs(a - b))) for a, b in zip(before, after))

    keras.mixed_precision.set_global_policy("mixed_float16")
    model, trainer, batches = _mlp_on_mesh(
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)), "topk",
        {"adam_front": True, "adam_warmup_steps": 1})
    reduction, opt = trainer.reduction, trainer.optimizer
    state = reduction.variables
    losses = [trainer.train_on_batch(*batches[i][:2])["loss"] for i in range(2)]
    before = host(model.weights), host(state), float(layout.to_host(opt.dynamic_scale.value))
    x, y = (np.array(a) for a in batches[2][:2])
    x[0, 0] = np.inf  # the first example: replica 0's part of the batch
    trainer.train_on_batch(x, y)
    after = host(model.weights), host(state), float(layout.to_host(opt.dynamic_scale.value))
    counter = float(layout.to_host(reduction.count))  # before the last step
    losses.append(trainer.train_on_batch(*batches[3][:2])["loss"])
    return {"reduction": type(reduction).__name__, "losses": losses,
            "counters": [counter],
            "tensors_nonzero": moved([s for s in before[1] if s.ndim],
                                     [0 * s for s in before[1] if s.ndim]),
            "state_moved": moved(before[1], after[1]),
            "weights_moved": moved(before[0], after[0]), "scales": [before[2], after[2]],
            "tensors_moved_next": moved([s for s in after[1] if s.ndim],
                                        [s for s in host(state) if s.ndim]),
            "weights_moved_next": moved(after[0], host(model.weights))}


if __name__ == "__main__":
    if sys.argv[1] == "mesh_steps":
        # fp32 first: `fp16_skip` leaves the mixed_float16 policy set.
        print(json.dumps({"warm_collectives": warm_collectives(),
                          "fp16_skip": fp16_skip()}), flush=True)
        sys.exit(0)
    comms = with_comm()
    reshard_child.main()
    print(json.dumps({"comm": comms}), flush=True)
