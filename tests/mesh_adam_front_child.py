"""Child process for tests/test_mesh_adam_front.py:
`python tests/mesh_adam_front_child.py RUNS_JSON OUT_PREFIX` or `... fp16_skip`.

- RUNS_JSON: `tests/reshard_child.py`'s runs (its docstring: what each run records, the
  final state saved as `OUT_PREFIX_<name>.npz` under `tfpar.state`'s names), each result
  also with its `comm` (the codec's bytes per step) when it has one.
- `fp16_skip`: a user's mlp on a 2×2 mesh under `mixed_float16`, Keras's
  `LossScaleOptimizer` over Adam, top-k with Adam in front (one exact step): two steps,
  a step whose batch holds one infinite input (replica 0's part), one more step; prints
  how far the codec's state (residuals, Adam's moments, the counter), the weights and the
  loss scale moved around the overflowing step.
"""

import json
import os
import sys

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


def fp16_skip():
    from layout_keras_child import LOSS, USER_LAYOUTS, arrays, seeded, task_for
    import keras
    import numpy as np
    from tfpar import layout

    def host(variables):
        return [np.asarray(layout.to_host(v.value if hasattr(v, "path") else v), "float64")
                for v in variables]

    def moved(before, after):
        return max(float(np.max(np.abs(a - b))) for a, b in zip(before, after))

    task, build = task_for("mlp")
    *_, batches = arrays(task, "mlp", 32, steps=4)
    keras.mixed_precision.set_global_policy("mixed_float16")
    model, trainer = layout.build_on_mesh(
        layout.make_mesh(2, 2), list(USER_LAYOUTS["mlp"].items()), lambda: seeded(build),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)), LOSS,
        compression="topk", codec_options={"adam_front": True, "adam_warmup_steps": 1})
    state, opt = trainer.reduction.variables, trainer.optimizer
    losses = [trainer.train_on_batch(*batches[i][:2])["loss"] for i in range(2)]
    before = host(model.weights), host(state), float(layout.to_host(opt.dynamic_scale.value))
    x, y = (np.array(a) for a in batches[2][:2])
    x[0, 0] = np.inf  # the first example: replica 0's part of the batch
    trainer.train_on_batch(x, y)
    after = host(model.weights), host(state), float(layout.to_host(opt.dynamic_scale.value))
    losses.append(trainer.train_on_batch(*batches[3][:2])["loss"])
    return {"reduction": type(trainer.reduction).__name__, "losses": losses,
            "counters": [float(s) for s in after[1] if s.ndim == 0],  # before the last
            "tensors_nonzero": moved([s for s in before[1] if s.ndim],
                                     [0 * s for s in before[1] if s.ndim]),
            "state_moved": moved(before[1], after[1]),
            "weights_moved": moved(before[0], after[0]), "scales": [before[2], after[2]],
            "tensors_moved_next": moved([s for s in after[1] if s.ndim],
                                        [s for s in host(state) if s.ndim]),
            "weights_moved_next": moved(after[0], host(model.weights))}


if __name__ == "__main__":
    if sys.argv[1] == "fp16_skip":
        print(json.dumps(fp16_skip()), flush=True)
        sys.exit(0)
    comms = with_comm()
    reshard_child.main()
    print(json.dumps({"comm": comms}), flush=True)
