"""Resumable training: run it, stop it at any point (Ctrl-C, kill -9), run it again.

    python backup_restore.py
"""
import numpy as np
import tensorflow as tf
import keras
import tfpar

backup = tfpar.callbacks.BackupAndRestore("backup", save_freq=7)

teacher = np.random.default_rng(0).normal(size=(16, 1)).astype("float32")


def batch_of_step(step):  # batch k is a function of k alone: the data can resume at any step
    x = tf.random.stateless_normal((32, 16), seed=tf.stack([step, 0]))
    return x, x @ teacher


# Start the data where the last run stopped (step 0 on a fresh start).
print("resuming at step", backup.initial_step)
dataset = tf.data.Dataset.range(backup.initial_step, 10**9).map(batch_of_step)

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="tanh"),
                          keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
model.fit(dataset, epochs=3, steps_per_epoch=20, callbacks=[backup], verbose=0)
model.save_weights("final.weights.h5")
print("trained to step", int(model.optimizer.iterations))
