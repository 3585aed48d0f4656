"""A walk through keras.io's guide "Distributed training with Keras 3" on TensorFlow.

The guide's steps in its order: list the devices, lay a mesh with a data and a model axis
over them, train with `DataParallel` on a 1D mesh, then with `ModelParallel` and a
`LayoutMap` (weights split on "model", a layer output laid out on "data"); `fit`, then
`evaluate`, each time. The data are generated 28 x 28 images a model can learn. Lines
marked `# tfpar:` are the ones a user adds for tfpar (docs/guides/keras_guides.md).

    python keras_distribution_tour.py
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"  # tfpar: Keras on TensorFlow, not JAX

from tfpar.devices import split_cpu  # tfpar: eight logical CPUs stand in for accelerators

split_cpu(8)  # tfpar: before TensorFlow starts; leave it out on real GPUs or TPUs

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tfpar.layout  # noqa: E402  # tfpar:

tfpar.layout.enable()  # tfpar: keras.distribution honoured on TensorFlow

keras.utils.set_random_seed(7)  # the same first weights and dropout masks on every run
CLASSES, BATCH, EPOCHS = 10, 16, 2


def glyph_images(count, seed=0):
    """`count` noisy 28 x 28 x 1 images of ten fixed random glyphs, with each one's class."""
    rng = np.random.default_rng(seed)
    glyphs = rng.uniform(size=(CLASSES, 28, 28, 1))
    classes = rng.integers(0, CLASSES, size=count)
    pictures = glyphs[classes] + rng.normal(scale=0.5, size=(count, 28, 28, 1))
    return pictures.astype("float32"), classes


pictures, classes = glyph_images(64)
batches = tf.data.Dataset.from_tensor_slices((pictures, classes)).batch(BATCH)

# Every device this process can place work on (the guide asks JAX for its GPUs).
accelerators = keras.distribution.list_devices()  # tfpar: Keras's list, not JAX's
print(f"{len(accelerators)} devices: {accelerators}")

# Eight devices as a 2 x 4 grid: two copies of the batch, each model split four ways.
grid = keras.distribution.DeviceMesh(
    shape=(2, 4), axis_names=["data", "model"], devices=accelerators)
# How one tensor sits on that grid: a matrix split by rows on "model", columns on
# "data"; a batch of images split along its first axis.
matrix_layout = keras.distribution.TensorLayout(axes=("model", "data"), device_mesh=grid)
image_layout = keras.distribution.TensorLayout(
    axes=("data", None, None, None), device_mesh=grid)


def classifier():
    """The guide's kind of model: flatten, a wide hidden layer, dropout, ten classes. The
    layer names are what the layout map below refers to."""
    images = keras.Input(shape=(28, 28, 1))
    features = keras.layers.Flatten()(images)
    features = keras.layers.Dense(128, activation="relu", name="hidden")(features)
    features = keras.layers.Dropout(0.25)(features)
    scores = keras.layers.Dense(CLASSES, activation="softmax", name="scores")(features)
    return keras.Model(images, scores)


def train_and_score(name):
    model = classifier()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(batches, epochs=EPOCHS, verbose=0)
    loss, accuracy = model.evaluate(batches, verbose=0)
    print(f"{name}: loss {loss:.4f}, accuracy {accuracy:.3f}")


# Data parallelism: one axis over all eight devices; every weight whole on each of them,
# each batch cut in eight. (`DataParallel()` alone would take every device it finds.)
line = keras.distribution.DeviceMesh(shape=(8,), axis_names=["data"], devices=accelerators)
keras.distribution.set_distribution(keras.distribution.DataParallel(device_mesh=line))
train_and_score("DataParallel on 8")

# Model parallelism: the hidden layer's weights split over "model" (its kernel by output
# columns, its bias alike), the batch over "data"; every weight no rule names stays whole.
# Keys are regular expressions matched against each weight's path.
layout_map = keras.distribution.LayoutMap(grid)
layout_map["hidden/kernel"] = (None, "model")
layout_map["hidden/bias"] = ("model",)
layout_map["scores/output"] = ("data", None)  # a layer's output gets a layout too
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data"))
train_and_score("ModelParallel on 2 x 4")
