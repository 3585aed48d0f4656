"""Your own model on data x tensor x pipeline parallelism (2 x 2 x 2, 8 CPU devices) through
Keras's own ModelParallel and model.fit, with PowerSGD over each stage's batch axis.

    python pipeline_3d.py
"""
import numpy as np
from tfpar.devices import split_cpu

split_cpu(8)  # 8 logical CPUs before TensorFlow starts; on real accelerators, drop this

import keras  # noqa: E402
import tfpar  # noqa: E402
import tfpar.layout  # noqa: E402

tfpar.layout.enable()  # Keras's keras.distribution, honoured on TensorFlow
mesh = keras.distribution.DeviceMesh((2, 2, 2), ["stage", "batch", "model"],
                                     devices=keras.distribution.list_devices())
layout_map = keras.distribution.LayoutMap(mesh)  # your layer names, split over "model"
layout_map["up.*/kernel"] = (None, "model")
layout_map["up.*/bias"] = ("model",)
layout_map["down.*/kernel"] = ("model", None)
keras.distribution.set_distribution(tfpar.layout.PipelineParallel(
    layout_map=layout_map, microbatches=4, schedule="1f1b"))

keras.utils.set_random_seed(0)
inputs = keras.Input((16,))
h = keras.layers.Dense(64, activation="relu", name="up_1")(inputs)
h = keras.layers.Dense(32, activation="relu", name="down_1")(h)
h = keras.layers.Dense(64, activation="relu", name="up_2")(h)
h = keras.layers.Dense(32, activation="relu", name="down_2")(h)
model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
model.compile(optimizer=tfpar.DistributedOptimizer(keras.optimizers.Adam(1e-2),
                                                   compression="powersgd", rank=2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16)).astype("float32")
y = x[:, :4].argmax(1)
history = model.fit(x, y, batch_size=32, epochs=3, verbose=0).history
print(f"loss {history['loss'][0]:.4f} -> {history['loss'][-1]:.4f}, "
      f"accuracy {history['accuracy'][-1]:.3f}")
model.save_weights("pipeline_3d.weights.h5")  # whole arrays: stock Keras loads them
