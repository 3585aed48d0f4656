"""Data parallel with PowerSGD-compressed gradients on your own model and data.

One process:  python data_parallel.py
Two workers:  tfpar-launch --workers=2 -- python data_parallel.py
"""
import hashlib

import numpy as np
import tensorflow as tf
import keras
import tfpar

import models
from models.classifier import build_classifier

strategy = tfpar.make_strategy()  # one process: 1 replica; under tfpar-launch: all workers

rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 16)).astype("float32")
y = np.argmax(x @ rng.normal(size=(16, 4)), axis=1)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)

with strategy.scope():
    keras.utils.set_random_seed(0)  # the same initial weights on every worker
    model = build_classifier()
    optimizer = tfpar.DistributedOptimizer(keras.optimizers.Adam(3e-3), compression="powersgd")
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(dataset, epochs=3, steps_per_epoch=20, verbose=0).history["loss"]

worker = getattr(strategy.cluster_resolver, "task_id", 0) or 0
digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]
print(f"worker {worker}: loss {history[0]:.4f} -> {history[-1]:.4f}, weights {digest}, "
      f"models from {models.__file__}")
tfpar.wait_for_workers()  # worker 0 hosts the coordination service: nobody leaves first
