"""Child process for tests: `python tests/stock_keras_child.py MODEL.keras WEIGHTS.h5`.

A user's script with stock Keras only (it fails if anything imported tfpar): loads the
`.keras` file `tfpar.checkpoint_tool export` wrote, predicts 8 inputs drawn with numpy's
`default_rng(0)`, loads the `.weights.h5` export into the same architecture and predicts
again; prints one JSON line `{"keras": [...], "weights_h5": [...]}`.
"""

import json
import sys

import keras
import numpy as np


def main():
    model = keras.models.load_model(sys.argv[1])
    x = np.random.default_rng(0).normal(size=(8, *model.input_shape[1:])).astype("float32")
    out = {"keras": model.predict(x, verbose=0).tolist()}
    fresh = keras.models.clone_model(model)
    fresh.load_weights(sys.argv[2])
    out["weights_h5"] = fresh.predict(x, verbose=0).tolist()
    assert not any(name == "tfpar" or name.startswith("tfpar.") for name in sys.modules)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
