"""Child process for tests: `python tests/checkpoint_schedule_child.py DIR`.

A user's script whose Keras Adam follows a learning-rate schedule
(`keras.optimizers.schedules.ExponentialDecay`, read by Keras at its raw iteration count,
which counts micro-batches under `gradient_accumulation_steps`) and saves with
`tfpar.callbacks.BackupAndRestore` every 4 batches. Three runs in this process, each
batch a function of its index only:

- `first`: K = 2, stopped by an exception after batch 14; its last save is at batch 12
  (6 updates). Its weights and optimizer variables at batch 12 are kept.
- `resumed`: K = 4, the same script resuming from that save, to batch 28.
- `reference`: K = 4 from the same state without a checkpoint: batch 12's weights and
  optimizer variables assigned, the raw count set to 6 updates × 4, trained on batches
  12 … 27.
- `fresh`: K = 4 from batch 0 to batch 40, uninterrupted: the learning rate of each of its
  10 updates.

Prints one JSON line: per run, the learning rate each update used (`{update: lr}`, the
update's index counted from the start), the updates done at the end
(`optimizer.iterations`), and the resumed and reference runs' final weights.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402

SAVED, STOP, TOTAL, FRESH = 12, 14, 28, 40
PER_EPOCH = 4


def data(start):
    """Batch `k` (8 examples) depends on `k` only."""
    def batch(k):
        x = tf.random.stateless_normal((8, 3), seed=tf.stack([k, tf.constant(0, tf.int64)]))
        return x, tf.reduce_sum(x, axis=1, keepdims=True) * 0.5 + 1.0
    return tf.data.Dataset.range(start, 10 ** 6).map(batch)


def build(k, seed):
    keras.utils.set_random_seed(seed)
    # Named: each run builds its model again in this process, as a rerun would afresh.
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(4, activation="tanh", name="hidden"),
                              keras.layers.Dense(1, name="out")], name="regressor")
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=8,
                                                           decay_rate=0.5)
    model.compile(optimizer=keras.optimizers.Adam(schedule, gradient_accumulation_steps=k),
                  loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


class Rates(keras.callbacks.Callback):
    """The learning rate each update used: read before a batch, kept where the batch
    applied an update (`optimizer.iterations`, the update count, grew)."""

    def __init__(self):
        super().__init__()
        self.rates, self._lr = {}, None

    def on_train_batch_begin(self, batch, logs=None):
        self._updates = int(self.model.optimizer.iterations)
        self._lr = float(self.model.optimizer.learning_rate)

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) > self._updates:
            self.rates[self._updates] = self._lr


class StopAfter(keras.callbacks.Callback):
    """Keeps the state after batch `SAVED` (counted from 0 at the first batch) and raises
    after batch `STOP`."""

    def __init__(self):
        super().__init__()
        self.batches, self.state = 0, None

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.batches == SAVED:
            self.state = ([w.numpy() for w in self.model.weights],
                          [v.numpy() for v in self.model.optimizer.variables])
        if self.batches == STOP:
            raise KeyboardInterrupt


def main():
    backup_dir = os.path.join(sys.argv[1], "backup")
    out = {}

    model = build(2, seed=0)
    backup = tfpar.callbacks.BackupAndRestore(backup_dir, save_freq=4)
    stop, rates = StopAfter(), Rates()
    try:
        model.fit(data(0), epochs=TOTAL // PER_EPOCH, steps_per_epoch=PER_EPOCH, verbose=0,
                  callbacks=[backup, rates, stop])
    except KeyboardInterrupt:
        pass
    out["first"] = {"rates": rates.rates, "initial_step": backup.initial_step}

    model = build(4, seed=1)  # other initial weights: the restore sets them
    backup = tfpar.callbacks.BackupAndRestore(backup_dir, save_freq=4)
    start, rates = backup.initial_step, Rates()
    model.fit(data(start), epochs=TOTAL // PER_EPOCH, steps_per_epoch=PER_EPOCH, verbose=0,
              callbacks=[backup, rates])
    out["resumed"] = {"rates": rates.rates, "start": start,
                      "updates": int(model.optimizer.iterations),
                      "weights": [w.numpy().tolist() for w in model.weights]}

    model = build(4, seed=1)
    weights, variables = stop.state
    for w, value in zip(model.weights, weights):
        w.assign(value)
    for v, value in zip(model.optimizer.variables, variables):
        v.assign(value)
    (iteration,) = [v for v in model.optimizer.variables if v.name == "iteration"]
    iteration.assign(SAVED // 2 * 4)  # 6 updates of K = 2, counted as a K = 4 run does
    rates = Rates()
    model.fit(data(SAVED), epochs=(TOTAL - SAVED) // PER_EPOCH, steps_per_epoch=PER_EPOCH,
              verbose=0, callbacks=[rates])
    out["reference"] = {"rates": rates.rates, "updates": int(model.optimizer.iterations),
                        "weights": [w.numpy().tolist() for w in model.weights]}

    model, rates = build(4, seed=0), Rates()
    model.fit(data(0), epochs=FRESH // PER_EPOCH, steps_per_epoch=PER_EPOCH, verbose=0,
              callbacks=[rates])
    out["fresh"] = {"rates": rates.rates, "updates": int(model.optimizer.iterations)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
