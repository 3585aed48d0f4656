"""Child of tests/test_guides.py: runs `examples/guides/keras_distribution_tour.py` (keras.io's
distribution guide, step by step) as a user would (`runpy`) and records every model it
fits: the weights after `fit` (saved to OUT.npz), the `History`, `evaluate`'s result and
each weight's sharding.

Usage: python tests/guides_child.py {mesh|single} OUT.npz

`mesh` runs the file as it is (tfpar on, its distributions set); `single` runs the same
code with `tfpar.layout.enable` and `keras.distribution.set_distribution` made no-ops:
every model on one device, the same seed (the script sets it) and data. Prints one JSON
line.
"""

import json
import os
import runpy
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOUR = os.path.join(ROOT, "examples", "guides", "keras_distribution_tour.py")

mode, out_path = sys.argv[1], sys.argv[2]

import keras  # noqa: E402
import tfpar.layout  # noqa: E402
from tfpar.layout import values  # noqa: E402

if mode == "single":
    tfpar.layout.enable = lambda: None
    keras.distribution.set_distribution = lambda distribution: None

fitted = []  # {"model", "history", "evaluate"} per model the script fits


def _recording(name):
    def call(self, *args, **kwargs):
        result = getattr(super(keras.Model, self), name)(*args, **kwargs)
        if name == "fit":
            fitted.append({"model": self, "history": result.history})
        else:
            fitted[-1]["evaluate"] = result
        return result
    return call


keras.Model.fit = _recording("fit")
keras.Model.evaluate = _recording("evaluate")
runpy.run_path(TOUR, run_name="__main__")

report = {"mode": mode, "fits": []}
arrays = {}
for i, run in enumerate(fitted):
    model = run["model"]
    layouts = {}
    for v in model.weights:
        arrays[f"{i}:{v.path}"] = values.to_host(v.value)
        layouts[v.path] = (list(v.value.layout.sharding_specs)
                           if tfpar.layout.is_dvariable(v) else None)
    report["fits"].append({"history": run["history"], "evaluate": run.get("evaluate"),
                           "layouts": layouts,
                           "iterations": int(values.to_host(model.optimizer.iterations))})
np.savez(out_path, **arrays)
print(json.dumps(report), flush=True)
