"""Child process for tests/test_layout_mesh.py, on 4 logical CPUs; prints one JSON line.

Usage: python tests/layout_mesh_child.py CASE[,CASE...] (the cases in turn; the JSON line
maps each to its result)
- `reduction`: the transformer on a 2×2 mesh, 5 SGD steps, with the batch-axis reduction
  of `tfpar.layout.reduction` at `compression="none"` against DTensor's implicit sum; and
  that tensor_parallel=2 × data_parallel=1 with int8 builds no reduction. (Adam through the
  reduction path against DTensor's sum: tests/test_layout_mesh.py's threshold at its limit
  on the mlp, tests/test_mesh_sequence_codecs.py's top-k at ratio 1 on the transformer.)
- `sequence`: the transformer with the `sequence_parallel` preset, 5 steps, Adam on a 2×2
  mesh and SGD on a 1×4 mesh, against the single-device run; which layer outputs were
  laid out.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from layout_keras_child import (LOSS, OPTIMIZERS, arrays, diffs, reference_once,  # noqa: E402
                                seeded, task_for)  # (imports split the CPU into 4)

import numpy as np  # noqa: E402

from tfpar import devices, layout  # noqa: E402
from tfpar.layout import activations, presets  # noqa: E402


def train(mesh, names, build, optimizer, batches, **options):
    model, trainer = layout.build_on_mesh(mesh, layout.preset_rules(names),
                                          lambda: seeded(build), OPTIMIZERS[optimizer],
                                          LOSS, **options)
    losses = [trainer.train_on_batch(*batch)["loss"] for batch in batches]
    return model, trainer, losses


def host(model):
    return [np.asarray(layout.to_host(v.value), "float64") for v in model.weights]


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def reduction():
    task, build = task_for("transformer")
    *_, batches = arrays(task, "transformer", 8)
    names = presets.model_presets("transformer")
    mesh = layout.make_mesh(2, 2)
    implicit, _, implicit_losses = train(mesh, names, build, "sgd", batches)
    reduced, trainer, losses = train(mesh, names, build, "sgd", batches, compression="none")
    out = {"sgd": {"diff": max_diff(host(reduced), host(implicit)),
                   "loss_diff": max(abs(a - b) for a, b in zip(losses, implicit_losses)),
                   "reduction": trainer.reduction is not None}}
    # One replica on `batch`: no data-parallel reduction is built, so no codec (built
    # only: trained, it would run the uncompressed step's own code).
    sub = layout.make_mesh(1, 2, devices.compute_devices()[:2])
    _, trainer, _ = train(sub, names, build, "adam", [], compression="int8")
    out["tp2_dp1_int8"] = {"reduction": trainer.reduction is not None}
    return out


def sequence():
    task, build = task_for("transformer")
    *_, batches = arrays(task, "transformer", 8)
    names = presets.model_presets("transformer",
                                  sequence_parallel=os.environ.get("NO_SP") is None)
    out = {}
    # Each mesh once and each optimizer once: the sequence layouts do not depend on the
    # optimizer (the step is the same; Adam, which magnifies rounding, on the mesh with
    # a batch axis too).
    for dp, tp, optimizer in ((2, 2, "adam"), (1, 4, "sgd")):
        mesh = layout.make_mesh(dp, tp)
        ref, ref_losses, _ = reference_once(("transformer", optimizer, 8), build,
                                            OPTIMIZERS[optimizer], batches)
        model, trainer, losses = train(mesh, names, build, optimizer, batches)
        per_path = diffs(model, ref)
        # The attention key bias apart: its true gradient is zero (softmax ignores a
        # constant shift of the scores), so its computed gradient is rounding noise,
        # which Adam normalises to steps of up to ~lr (tests/test_layout_exact.py).
        out[f"{dp}x{tp} {optimizer}"] = {
            "diff": max(v for k, v in per_path.items() if not k.endswith("key/bias")),
            "key_bias_diff": max(v for k, v in per_path.items() if k.endswith("key/bias")),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "laid_out": sorted(activations.laid_out(model))}
    return out


def run_cases(names):
    """Each case in turn in this process (one TensorFlow start; a DTensor mesh can be
    rebuilt): {case: its JSON, or {"error": the traceback} when it raised}, so that a
    failing case fails only its own tests."""
    import traceback
    out = {}
    for name in names:
        try:
            out[name] = {"reduction": reduction, "sequence": sequence}[name]()
        except Exception:  # noqa: BLE001 - reported to the test that reads this case
            out[name] = {"error": traceback.format_exc()[-5000:]}
    return out


if __name__ == "__main__":
    print(json.dumps(run_cases(sys.argv[1].split(","))), flush=True)
