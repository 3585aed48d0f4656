"""Child process for tests/test_compression_dgc.py: `python tests/dgc_child.py`.

Momentum SGD against top-k with DGC's momentum correction on a MirroredStrategy of 4
logical CPUs: exactness with every entry sent, then 300 steps at 1 %; prints one JSON line.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from tfpar.devices import split_cpu  # noqa: E402
import tensorflow as tf  # noqa: E402
split_cpu(4)
import keras  # noqa: E402
from tfpar.compression import NoneAggregator, TopKAggregator, wrap_optimizer  # noqa: E402

STEPS, BATCH, D, HIDDEN = 300, 256, 32, 128
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
rng = np.random.default_rng(0)
w1, w2 = rng.normal(size=(D, 16)) / np.sqrt(D), rng.normal(size=(16, 1)) / 4
x = rng.normal(size=(STEPS * BATCH + 4096, D)).astype("float32")
t = np.tanh(x @ w1) @ w2
y = (t / t.std() + 0.2 * rng.normal(size=t.shape)).astype("float32")
x_eval, y_eval = x[-4096:], y[-4096:]

def run(agg, steps, lr=0.05, cosine=True):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        m = keras.Sequential([keras.Input((D,)), keras.layers.Dense(HIDDEN, activation="relu"),
                              keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(1)])
        # (A constant rate for the exactness check: Keras's buffer holds -lr·velocity.)
        rate = keras.optimizers.schedules.CosineDecay(lr, steps) if cosine else lr
        opt = keras.optimizers.SGD(rate, momentum=0.9)
        m.compile(optimizer=wrap_optimizer(opt, agg) if agg else opt, loss="mse")
    n = steps * BATCH
    m.fit(x[:n], y[:n], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return m, float(m.evaluate(x_eval, y_eval, batch_size=4096, verbose=0))

out = {}
# Every entry sent, no masking: the aggregator's velocity is momentum SGD's buffer.
plain, _ = run(NoneAggregator(), 20, cosine=False)
dgc_full, _ = run(TopKAggregator(1.0, momentum=0.9, momentum_masking=False, union=False,
                                 dense_below=0), 20, cosine=False)
out["full_max_diff"] = max(float(np.max(np.abs(a.numpy() - b.numpy())))
                           for a, b in zip(plain.trainable_variables, dgc_full.trainable_variables))
# With masking (the default) too: at ratio 1 every tensor goes whole, and a tensor sent whole
# keeps its velocity (masked, it would train as SGD without momentum).
dgc_whole, _ = run(TopKAggregator(1.0, momentum=0.9, union=False, dense_below=0), 20, cosine=False)
out["whole_max_diff"] = max(float(np.max(np.abs(a.numpy() - b.numpy())))
                            for a, b in zip(plain.trainable_variables, dgc_whole.trainable_variables))
for name, agg in [("none", None),
                  ("dgc", TopKAggregator(0.01, momentum=0.9, union=False, dense_below=0)),
                  ("topk_no_correction", TopKAggregator(0.01, union=False, dense_below=0))]:
    m, out[name] = run(agg, STEPS)
    if agg is not None:
        out[name + "_identical"] = all(
            np.array_equal(r[0].numpy(), c.numpy())
            for r in (strategy.experimental_local_results(v.value) for v in m.trainable_variables)
            for c in r)
print(json.dumps(out))
