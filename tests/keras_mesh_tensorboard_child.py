"""Child process for tests: `python tests/keras_mesh_tensorboard_child.py LOG_DIR MESH`
fits a user's functional model under a Keras distribution with
`tfpar.DistributedOptimizer(SGD, compression="int8")` and `tfpar.callbacks.TensorBoard`:
MESH `2d` is `keras.distribution.ModelParallel` on a (batch 2, model 2) mesh, `3d`
`tfpar.layout.PipelineParallel` on (stage 2, batch 2, model 2). Prints a JSON line: the
steps taken, the model's gradient entries and tensors, and `tfpar.metrics.comm_stats`
after the fit. (The codec runs in the mesh's `batch` reduction there, not in the
optimizer's aggregator, which is never built: the callback raised on its first step
before 2026-12-06.)"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar.devices import split_cpu  # noqa: E402

MESH = sys.argv[2]
split_cpu(8 if MESH == "3d" else 4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfpar  # noqa: E402
from tfpar import layout, metrics  # noqa: E402

STEPS = 4


def distribution():
    axes = ["stage", "batch", "model"] if MESH == "3d" else ["batch", "model"]
    mesh = keras.distribution.DeviceMesh((2,) * len(axes), axes,
                                         keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["wide.*/kernel"] = (None, "model")
    layout_map["wide.*/bias"] = ("model",)
    layout_map["narrow.*/kernel"] = ("model", None)
    if MESH == "3d":
        return layout.PipelineParallel(layout_map=layout_map, microbatches=2)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def main():
    layout.enable()
    keras.distribution.set_distribution(distribution())
    keras.utils.set_random_seed(1)
    inputs = keras.Input((20,), name="x")
    h = keras.layers.Dense(48, activation="gelu", name="wide_a")(inputs)
    h = keras.layers.Dense(24, activation="tanh", name="narrow_a")(h)
    h = keras.layers.Dense(48, activation="relu", name="wide_b")(h)
    h = keras.layers.Dense(24, activation="relu", name="narrow_b")(h)
    outputs = keras.layers.Dense(3, name="out")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=tfpar.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                                       compression="int8"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32 * STEPS, 20)).astype("float32")
    y = x[:, :3].argmax(1).astype("int32")
    board = tfpar.callbacks.TensorBoard(sys.argv[1])
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[board])
    print(json.dumps({"steps": STEPS,
                      "entries": sum(int(np.prod(w.shape)) for w in model.trainable_weights),
                      "tensors": len(model.trainable_weights),
                      "comm": metrics.comm_stats(model, 1)}))


if __name__ == "__main__":
    main()
