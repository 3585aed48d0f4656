"""Your own model as a 2-stage pipeline (1F1B over 4 micro-batches) on two CPU devices.

    python pipeline.py
"""
import numpy as np
import keras
import tfpar

tfpar.make_strategy("one_device", cpu_devices=2)  # two logical CPUs for the two stages

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
pipeline = tfpar.PipelineModel.split(model, stages=2, schedule="1f1b", microbatches=4)
pipeline.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16)).astype("float32")
y = x @ rng.normal(size=(16, 1)).astype("float32")
history = pipeline.fit(x, y, batch_size=32, epochs=3, verbose=0).history["loss"]
print(f"loss {history[0]:.4f} -> {history[-1]:.4f}")
