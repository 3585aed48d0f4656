"""A walk through tensorflow.org's tutorial "Multi-worker training with Keras", Keras 3.

The tutorial's steps in its order: each worker reads its `TF_CONFIG`, builds
`tf.distribute.MultiWorkerMirroredStrategy()`, makes a `tf.data` pipeline of the global
batch (per-worker batch x workers), builds and compiles a small convnet inside
`strategy.scope()`, and calls `fit`. The images are generated 28 x 28 digits-like pictures
(no download). Lines marked `# tfpar:` are the ones a user adds for tfpar
(docs/guides/keras_guides.md). Start one process per worker, each with its own index:

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]},
                "task": {"type": "worker", "index": 0}}' python multi_worker_tutorial.py &
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]},
                "task": {"type": "worker", "index": 1}}' python multi_worker_tutorial.py

(or `tfpar-launch --workers=2 -- python multi_worker_tutorial.py`, which sets them).
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf
import tfpar  # tfpar:

BATCH_PER_WORKER = 64
EPOCHS, STEPS_PER_EPOCH = 2, 4
SEED = 21  # every worker shuffles alike and starts from the same weights


def digit_pictures(count=2048):
    """Stand-ins for MNIST's training split: uint8 pictures in 0..255 (a fixed pattern per
    class, plus noise) and uint8 labels."""
    rng = np.random.default_rng(SEED)
    patterns = rng.integers(0, 256, size=(10, 28, 28))
    labels = rng.integers(0, 10, size=count)
    pictures = patterns[labels] + rng.integers(-80, 80, size=(count, 28, 28))
    return np.clip(pictures, 0, 255).astype(np.uint8), labels.astype(np.uint8)


def training_batches(global_batch):
    """Endless shuffled batches of `global_batch` pictures scaled to [0, 1]."""
    pictures, labels = digit_pictures()
    pairs = tf.data.Dataset.from_tensor_slices(
        (pictures.astype(np.float32) / 255.0, labels.astype(np.int64)))
    return pairs.shuffle(len(labels), seed=SEED).repeat().batch(global_batch)


def convnet():
    """One convolution, one hidden layer, ten logits; compiled with plain SGD."""
    model = keras.Sequential([
        keras.Input(shape=(28, 28)),
        keras.layers.Reshape((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main():
    keras.utils.set_random_seed(SEED)
    tfpar.enable()  # tfpar: Keras 3's fit works under the strategy below
    cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch = BATCH_PER_WORKER * len(cluster["worker"])
    batches = training_batches(global_batch)
    with strategy.scope():  # variables are mirrored only if created in here
        model = convnet()
    model.fit(batches, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH)
    return model


if __name__ == "__main__":
    main()
