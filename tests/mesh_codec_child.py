"""Child process for tests/test_mesh_codec_compose.py, on 4 logical CPUs; prints one JSON
line mapping each case to its result.

Usage: python tests/mesh_codec_child.py CASE[,CASE...]
- `fp16_skip`: a user's mlp (its layers split over `model`) on a 2×2 mesh under `mixed_float16`, SGD behind Keras's
  `LossScaleOptimizer`, int8 and PowerSGD on the batch-axis reduction: two steps, then a
  step whose batch holds one infinite input (on replica 0 only), then one more step; what
  the codec's state (residuals, `Q`s), the weights and the loss scale were around the
  overflowing step.
- `reshard`: the codecs' state (residuals, `Q`s) saved by `tfpar.state` on a 2×2 mesh and
  loaded onto a fresh 2×2 mesh and onto a 4×1 one: names, differences, residual sums.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import cases  # noqa: E402
import graph_optimizer  # noqa: E402
from layout_keras_child import (LOSS, USER_LAYOUTS, arrays, seeded,  # noqa: E402
                                task_for)  # (imports split the CPU into 4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import layout  # noqa: E402


def _host(variables):
    return [np.asarray(layout.to_host(v.value if hasattr(v, "path") else v), "float64")
            for v in variables]


def _changed(before, after):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(before, after))


def fp16_skip():
    task, build = task_for("mlp")
    *_, batches = arrays(task, "mlp", 32, steps=4)
    keras.mixed_precision.set_global_policy("mixed_float16")
    out = {}
    try:
        for codec in ("int8", "powersgd"):
            mesh = layout.make_mesh(2, 2)
            model, trainer = layout.build_on_mesh(
                mesh, list(USER_LAYOUTS["mlp"].items()), lambda: seeded(build),
                lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
                LOSS, compression=codec, codec_options={"powersgd_rank": 2})
            state = trainer.reduction.variables
            opt = trainer.optimizer
            losses = [trainer.train_on_batch(*batches[i][:2])["loss"] for i in range(2)]
            before = {"weights": _host(model.weights), "state": _host(state),
                      "scale": float(layout.to_host(opt.dynamic_scale.value))}
            x, y = (np.array(a) for a in batches[2][:2])
            x[0, 0] = np.inf  # the first example: replica 0's part of the batch
            skipped = trainer.train_on_batch(x, y)["loss"]
            after = {"weights": _host(model.weights), "state": _host(state),
                     "scale": float(layout.to_host(opt.dynamic_scale.value))}
            losses.append(trainer.train_on_batch(*batches[3][:2])["loss"])
            out[codec] = {
                "losses": losses, "skipped_loss": skipped,
                "state_sizes": len(state), "state_before": _changed(before["state"],
                                                                     [0 * s for s in
                                                                      before["state"]]),
                "state_moved": _changed(before["state"], after["state"]),
                "weights_moved": _changed(before["weights"], after["weights"]),
                "scales": [before["scale"], after["scale"]],
                "state_moved_next": _changed(after["state"], _host(state)),
                "weights_moved_next": _changed(after["weights"], _host(model.weights))}
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return out


def reshard():
    """The codec state saved by `tfpar.state` on a 2×2 mesh (3 int8 and PowerSGD steps),
    loaded onto a fresh 2×2 mesh and onto a 4×1 one."""
    import tempfile

    import tensorflow as tf

    from tfpar import state
    task, build = task_for("mlp")
    *_, batches = arrays(task, "mlp", 32, steps=3)
    out = {}
    for codec in ("int8", "powersgd"):
        def built(dp, tp):
            return layout.build_on_mesh(
                layout.make_mesh(dp, tp), list(USER_LAYOUTS["mlp"].items()),
                lambda: seeded(build), lambda: keras.optimizers.SGD(0.1), LOSS,
                compression=codec, codec_options={"powersgd_rank": 2})
        model, trainer = built(2, 2)
        for batch in batches:
            trainer.train_on_batch(*batch[:2])
        path = tf.train.Checkpoint(state=state.LayoutState(model)).write(
            os.path.join(tempfile.mkdtemp(), "ckpt"))
        saved = {k: v for k, v in state.tensors_of(path).items() if k.startswith("codec/")}
        same, _ = built(2, 2)
        state.LayoutState(same).load(path)
        other, _ = built(4, 1)
        state.LayoutState(other).load(path)
        reloaded = [{k: e[0]() for k, e in state.LayoutState(m).entries().items()
                     if k.startswith("codec/")} for m in (same, other)]
        residuals = [k for k in saved if k.endswith("/residual")]
        out[codec] = {
            "names": sorted(saved),
            "same_diff": max(float(np.max(np.abs(reloaded[0][k] - v)))
                             for k, v in saved.items()),
            "rows": [int(saved[residuals[0]].shape[0]),
                     int(reloaded[1][residuals[0]].shape[0])],
            # per residual, what its rows owe the mean gradient (a mesh's row is its
            # replica's own error: their mean): on the 4 replicas minus the saved 2's
            "owed_diff": max(float(np.max(np.abs(reloaded[1][k].sum(0) / 4
                                                 - saved[k].sum(0) / 2)))
                             for k in residuals),
            "largest": max(float(np.max(np.abs(saved[k]))) for k in residuals),
            "q_diff": max([float(np.max(np.abs(reloaded[1][k] - v)))
                           for k, v in saved.items() if k.endswith("/powersgd_q")],
                          default=None)}
    return out


CASES = {"fp16_skip": fp16_skip, "reshard": reshard}

if __name__ == "__main__":
    graph_optimizer.apply()  # the test's choice (tests/graph_optimizer.py)
    out = cases.run_cases(CASES, sys.argv[1].split(","))
    out["grappler"] = graph_optimizer.setting()  # what the cases ran with
    print(json.dumps(out), flush=True)
