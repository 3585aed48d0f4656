"""Child process for tests/test_compression_keras.py: `python tests/keras_hook_child.py
TMP_DIR`.

Plain `model.compile` + `model.fit` under a MirroredStrategy of 4 logical CPUs with
`wrap_optimizer`: the hook, an aggregator returning zeros, gradient accumulation, fp16 loss
scaling and one replica. Saves a model and a checkpoint under TMP_DIR; prints one JSON line.
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
from tfpar.compression import (  # noqa: E402
    Int8Aggregator, NoneAggregator, TopKAggregator, wrap_optimizer)

TMP = sys.argv[1]
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16)).astype("float32")
y = (x @ rng.normal(size=(16, 1))).astype("float32")
res = {}

def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(1)])

def weights(m):
    return [v.numpy() for v in m.trainable_variables]

def fit(make_opt, batch, steps, agg=None):
    # Keras optimizers belong to the strategy in scope when they are created.
    with strategy.scope():
        m = model()
        m.compile(optimizer=wrap_optimizer(make_opt(), agg or NoneAggregator()), loss="mse")
    h = m.fit(x[:batch * steps], y[:batch * steps], batch_size=batch, epochs=1, shuffle=False,
              verbose=0)
    return m, h.history["loss"][-1]

# 1. The hook runs, the optimizer stays an Adam, its config and serialisation are unchanged.
agg = TopKAggregator(0.1, union=False, dense_below=0)
m, _ = fit(lambda: keras.optimizers.Adam(1e-2), 32, 8, agg)
opt = m.optimizer
plain = keras.optimizers.Adam(1e-2)
res["hook"] = {
    "traced": agg.trace_count, "is_adam": isinstance(opt, keras.optimizers.Adam),
    "has_agg": opt.tfpar_aggregator is agg,
    "config_same": {k: v for k, v in opt.get_config().items() if k != "name"} ==
                   {k: v for k, v in plain.get_config().items() if k != "name"},
    "roundtrip": type(keras.optimizers.deserialize(keras.optimizers.serialize(opt))).__name__,
    "steps": int(agg.step.numpy())}
m.save(os.path.join(TMP, "m.keras"))
reloaded = keras.models.load_model(os.path.join(TMP, "m.keras"))
res["hook"]["reloaded"] = type(reloaded.optimizer).__name__
# The optimizer's checkpoint carries the aggregator's per-replica residuals.
path = tf.train.Checkpoint(optimizer=opt).save(os.path.join(TMP, "ckpt"))
res["hook"]["ckpt_keys"] = [n for n, _ in tf.train.list_variables(path) if "tfpar_aggregator" in n]

# 2. Keras uses what the aggregator returns: an aggregator that returns zeros freezes SGD.
class Zeros(NoneAggregator):
    def all_reduce_sum(self, grads, variables):
        self.trace_count += 1
        return [tf.zeros_like(g) for g in grads]
zero = Zeros()
m, _ = fit(lambda: keras.optimizers.SGD(0.1), 32, 4, zero)
res["zeros"] = {"traced": zero.trace_count,
                "unchanged": all(np.array_equal(a, b)
                                 for a, b in zip(weights(m), weights(model())))}

# 3. gradient_accumulation_steps=2 on batches of 32 == no accumulation on batches of 64.
m_acc, _ = fit(lambda: keras.optimizers.SGD(0.05, gradient_accumulation_steps=2), 32, 8)
m_big, _ = fit(lambda: keras.optimizers.SGD(0.05), 64, 4)
res["accum"] = {"max_diff": max(float(np.max(np.abs(a - b)))
                                for a, b in zip(weights(m_acc), weights(m_big))),
                "moved": max(float(np.max(np.abs(a - b)))
                             for a, b in zip(weights(m_acc), weights(model())))}

# 4. mixed_float16 + LossScaleOptimizer: the inner optimizer is wrapped.
keras.mixed_precision.set_global_policy("mixed_float16")
agg = Int8Aggregator()
with strategy.scope():
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    m = model()
    m.compile(optimizer=wrap_optimizer(lso, agg), loss="mse")
h = m.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
keras.mixed_precision.set_global_policy("float32")
copies = [strategy.experimental_local_results(v.value) for v in m.trainable_variables]
res["lso"] = {"traced": agg.trace_count, "loss": h.history["loss"], "steps": int(agg.step.numpy()),
              "same": all(np.array_equal(c[0].numpy(), r.numpy()) for c in copies for r in c)}

# 5. One replica: nothing to communicate, the aggregator is not called.
agg = TopKAggregator(0.01, union=False, dense_below=0)
m = model()
m.compile(optimizer=wrap_optimizer(keras.optimizers.SGD(0.05), agg), loss="mse")
m.fit(x[:64], y[:64], batch_size=32, verbose=0)
res["single"] = {"traced": agg.trace_count}
print(json.dumps(res))
