"""Stock Keras on one device (no tfpar): loads the Gemma that hub_model_parallel.py trained
on a 2x2 mesh and saved with `model.save`, and predicts as the mesh did.

python hub_load_one_device.py   (after hub_model_parallel.py)
"""
import sys

import keras
import keras_hub  # noqa: F401  (registers Gemma's classes for load_model)
import numpy as np

model = keras.models.load_model("gemma_mesh.keras")
saved = np.load("gemma_mesh.npz")
x = {"token_ids": saved["token_ids"], "padding_mask": np.ones_like(saved["token_ids"], bool)}
logits = model.predict(x, batch_size=16, verbose=0)
print("max |logits - mesh logits|", float(np.max(np.abs(logits - saved["logits"]))))
print("tfpar imported:", any(m.split(".")[0] == "tfpar" for m in sys.modules))
