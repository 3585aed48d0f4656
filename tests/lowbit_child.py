"""Child process for tests/test_compression_lowbit.py: `python tests/lowbit_child.py`.

Issue 43's user model (Zipf-distributed tokens, Embedding + LSTM + Dense, Keras's Adam) on
2 replicas through `tfpar.DistributedOptimizer(opt, compression="lowbit")` at its defaults
(Adam's exact warm-up shortened to 10 steps so most of the run compresses), against the same
fit with the plain Adam. Prints one JSON line: per run the losses, whether every weight is
finite, the largest weight, and the aggregator's bytes per step.
"""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tfpar  # noqa: E402

strategy = tfpar.make_strategy(cpu_devices=2)
import keras  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, CLASSES = 10000, 8, 32, 60, 4
rng = np.random.default_rng(0)
p = 1.0 / np.arange(1, VOCAB + 1)
x = rng.choice(VOCAB, size=(BATCH * STEPS, SEQ), p=p / p.sum()).astype("int32")
y = rng.integers(0, CLASSES, size=VOCAB)[x[:, -1]]  # the class of the last token


def fit(compression):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        m = keras.Sequential([keras.Input((SEQ,), dtype="int32"),
                              keras.layers.Embedding(VOCAB, 16), keras.layers.LSTM(32),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(CLASSES)])
        opt = keras.optimizers.Adam(1e-2)
        if compression is not None:
            opt = tfpar.DistributedOptimizer(opt, compression=compression,
                                             adam_warmup_steps=10)
        m.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                   callbacks=[tfpar.callbacks.NaNGuard()])
    weights = [v.numpy() for v in m.trainable_variables]
    agg = tfpar.compression.aggregator_of(m.optimizer)
    return {"final_loss": losses.history["loss"][-1],
            "finite": all(bool(np.isfinite(w).all()) for w in weights)
            and math.isfinite(losses.history["loss"][-1]),
            "max_abs_weight": max(float(np.abs(w).max()) for w in weights),
            "comm": agg.comm_stats() if agg is not None else None}


print(json.dumps({"plain": fit(None), "lowbit": fit("lowbit")}))
