"""A user's own training script, for tests: `python user_resume.py BACKUP_DIR OUT.npz
[pause|raise STEP]`.

Their model (from their package `models`), 2 CPU replicas, PowerSGD-compressed gradients
(per-replica error feedback) and `tfpar.callbacks.BackupAndRestore(save_freq=7)` over 3
epochs of 20 steps: every save falls mid-epoch. `pause STEP` prints `paused at STEP` after
that step and waits to be killed; `raise STEP` raises there. Saves the final weights and
prints the step it resumed at.
"""

import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfpar
from models.classifier import build_classifier


class Interrupt(keras.callbacks.Callback):
    def __init__(self, how, step):
        super().__init__()
        self.how, self.step = how, step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) != self.step:
            return
        if self.how == "raise":
            raise RuntimeError(f"interrupted at step {self.step}")
        print(f"paused at {self.step}", flush=True)
        time.sleep(600)  # until the test kills this process


def main():
    backup_dir, out = sys.argv[1], sys.argv[2]
    strategy = tfpar.make_strategy(cpu_devices=2)
    backup = tfpar.callbacks.BackupAndRestore(backup_dir, save_freq=7)
    print("resuming at step", backup.initial_step, flush=True)
    teacher = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")

    def batch_of_step(step):
        x = tf.random.stateless_normal((32, 16), seed=tf.stack([step, 7]))
        return x, tf.argmax(x @ teacher, axis=1)

    dataset = tf.data.Dataset.range(backup.initial_step, 10 ** 9).map(batch_of_step)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = build_classifier()
        model.compile(optimizer=tfpar.DistributedOptimizer(keras.optimizers.Adam(3e-3),
                                                           compression="powersgd", rank=2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [backup] + ([Interrupt(sys.argv[3], int(sys.argv[4]))] if len(sys.argv) > 3
                            else [])
    model.fit(dataset, epochs=3, steps_per_epoch=20, verbose=0, callbacks=callbacks)
    np.savez(out, *model.get_weights())
    print("trained to step", int(model.optimizer.iterations.numpy()), flush=True)


if __name__ == "__main__":
    main()
