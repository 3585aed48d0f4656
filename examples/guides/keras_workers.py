"""Keras's distribution API across worker processes: one 2 x 2 `DeviceMesh` over the
devices of every process, `ModelParallel` with a `LayoutMap`, plain `fit`.

One process, 4 logical CPUs:   python keras_workers.py 4
Two processes, 2 CPUs each:    tfpar-launch --workers=2 -- python keras_workers.py 2
"""
import json
import sys

import numpy as np
from tfpar.devices import split_cpu

split_cpu(int(sys.argv[1]))  # logical CPUs in this process, before TensorFlow starts
import keras  # noqa: E402
import tfpar  # noqa: E402
import tfpar.layout  # noqa: E402

tfpar.layout.enable()
keras.distribution.initialize()  # joins the processes of TF_CONFIG (tfpar-launch sets it)

mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                     devices=keras.distribution.list_devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["mlp/up/kernel"] = (None, "model")  # column-parallel ...
layout_map["mlp/up/bias"] = ("model",)
layout_map["mlp/down/kernel"] = ("model", None)  # ... then row-parallel
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))

keras.utils.set_random_seed(0)  # the same weights and data in every process
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16)).astype("float32")
y = np.argmax(x @ rng.normal(size=(16, 4)), axis=1)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, name="up"),
                          keras.layers.Activation("relu"), keras.layers.Dense(32, name="down"),
                          keras.layers.Dense(4, name="head")], name="mlp")
model.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
history = model.fit(x, y, batch_size=64, epochs=2, verbose=0).history
print(json.dumps({"devices": [str(d) for d in mesh.devices.ravel()], **history}))
tfpar.wait_for_workers()  # worker 0 hosts the coordination service: nobody leaves first
