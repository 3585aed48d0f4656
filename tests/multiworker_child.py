"""Child process for tests/test_compression_multiworker.py: one worker of two,
`TF_CONFIG=... python tests/multiworker_child.py` (MultiWorkerMirroredStrategy, each worker
its own data). Trains with PowerSGD and top-k, round-trips the top-k residuals through a
checkpoint, prints one JSON line (weights' hash, losses, bytes, residual hash per
aggregator) and waits for the other worker before leaving.
"""

import hashlib
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402
from tfpar.compression import PowerSGDAggregator, TopKAggregator, wrap_optimizer  # noqa: E402

task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=60))
rng = np.random.default_rng(task)  # each worker sees different data
x = rng.normal(size=(20, 32, 16)).astype("float32")
y = (x @ np.linspace(-1, 1, 16).reshape(16, 1)).astype("float32")
out = {}
for name, agg in [("powersgd", PowerSGDAggregator(rank=2, start_step=3)),
                  ("topk", TopKAggregator(0.05, union=False, dense_below=0))]:
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
        opt = wrap_optimizer(keras.optimizers.SGD(0.05), agg)
        opt.build(model.trainable_variables)

    @tf.function
    def step(xb, yb):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                # Divided by all replicas, as Keras does: the aggregator returns the sum.
                loss = tf.reduce_mean((model(xb) - yb) ** 2) / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(xb, yb)), axis=None)

    losses = [float(step(tf.constant(x[i]), tf.constant(y[i]))) for i in range(len(x))]
    weights = b"".join(v.numpy().tobytes() for v in model.trainable_variables)
    residual = agg.residuals["0"] if "0" in agg.residuals else next(iter(agg.residuals.values()))
    out[name] = {"hash": hashlib.sha256(weights).hexdigest(), "losses": losses,
                 "traced": agg.trace_count, "comm": agg.comm_stats(),
                 "residual_hash": hashlib.sha256(strategy.experimental_local_results(
                     residual)[0].numpy().tobytes()).hexdigest()}

# Checkpoint round trip: every worker's replica gets its own residual back (the save
# gathers all workers' residuals, so one file holds them all). agg: the top-k one.
path = tf.train.Checkpoint(agg=agg).save(os.path.join(tempfile.mkdtemp(), "agg"))
saved = dict(tf.train.list_variables(path))
with strategy.scope():
    fresh = TopKAggregator(0.05, union=False, dense_below=0)
    fresh.build([v.value for v in model.trainable_variables])
tf.train.Checkpoint(agg=fresh).restore(path).assert_existing_objects_matched()
own = [strategy.experimental_local_results(agg.residuals[k])[0].numpy() for k in agg.residuals]
back = [strategy.experimental_local_results(fresh.residuals[k])[0].numpy()
        for k in agg.residuals]
out["ckpt"] = {"own": all(np.array_equal(a, b) for a, b in zip(own, back)),
               "rows": saved["agg/residual_slots/0/.ATTRIBUTES/per_replica"][0]}
print(json.dumps(out), flush=True)
# Worker 0 hosts the coordination service: no worker leaves before the others are done.
assert tfpar.wait_for_workers("end", 120)
