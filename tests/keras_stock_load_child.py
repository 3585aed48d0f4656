"""Child process for tests/test_layout_keras_state.py: stock Keras on one device, never
importing tfpar, loads what tests/layout_keras_state_child.py saved — a model and a weights
file saved on a 2×2 mesh, and a model compiled with `tfpar.DistributedOptimizer` — and
prints one JSON line comparing them with the arrays saved next to them.

Usage: python tests/keras_stock_load_child.py DIR
"""

import json
import os
import sys

import keras
import numpy as np


def equal(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))


def main(folder):
    out = {}
    saved = np.load(os.path.join(folder, "mesh22.npz"))
    weights = [saved[f"w{i}"] for i in range(len(saved.files) - 2)]
    model = keras.models.load_model(os.path.join(folder, "mesh22.keras"))
    out["mesh22_model"] = {
        "bit_equal": equal(model.get_weights(), weights),
        "predict_diff": max_diff(model.predict(saved["x"], batch_size=8, verbose=0),
                                 saved["predictions"])}
    fresh = keras.Model.from_config(model.get_config())  # the user's architecture, new weights
    fresh.load_weights(os.path.join(folder, "mesh22.weights.h5"))
    out["mesh22_weights_file_bit_equal"] = equal(fresh.get_weights(), weights)

    state = np.load(os.path.join(folder, "distributed.npz"))
    model = keras.models.load_model(os.path.join(folder, "distributed.keras"))
    out["distributed"] = {
        "optimizer": f"{type(model.optimizer).__module__}.{type(model.optimizer).__name__}",
        "state_equal": equal([np.asarray(v) for v in model.optimizer.variables],
                             [state[f"o{i}"] for i in range(len(state.files) - 1)]),
        "predict_diff": max_diff(model.predict(saved["x"], batch_size=8, verbose=0),
                                 state["predictions"])}
    out["tfpar_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "tfpar")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
