"""`measure_comm_fraction`: a share and an overlap between 0 and 1 for each aggregator,
measured without touching the run's own aggregator state."""

from subproc import last_json_line, run_python

CHILD = r"""
import json
import numpy as np
from tfpar.devices import split_cpu
split_cpu(4)
import keras
import tensorflow as tf
from tfpar.compression import PowerSGDAggregator, TopKAggregator, wrap_optimizer
from tfpar.compression.timing import measure_comm_fraction

strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
x = np.random.default_rng(0).normal(size=(64, 256)).astype("float32")
y = (x[:, :1] > 0).astype("int32")
data = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(64).repeat())
out = {}
for name, agg in [("none", None), ("topk", TopKAggregator(0.01)),
                  ("powersgd", PowerSGDAggregator(rank=4, start_step=10))]:
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(2)])
        opt = keras.optimizers.SGD(0.1)
        model.compile(optimizer=wrap_optimizer(opt, agg) if agg else opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data, steps_per_epoch=2, epochs=1, verbose=0)
    state = ([v.numpy() for r in agg.residuals.values()
              for v in strategy.experimental_local_results(r)] + [agg.step.numpy()]) if agg else []
    fraction, times = measure_comm_fraction(strategy, model, data, steps=3)
    after = ([v.numpy() for r in agg.residuals.values()
              for v in strategy.experimental_local_results(r)] + [agg.step.numpy()]) if agg else []
    out[name] = {"fraction": fraction, **times,
                 "untouched": all(np.array_equal(a, b) for a, b in zip(state, after))}
print(json.dumps(out))
"""


def test_comm_fraction_per_aggregator_leaves_state_alone():
    out = last_json_line(run_python(CHILD, timeout=240).stdout)
    print(out)
    for name, r in out.items():
        assert 0.0 <= r["fraction"] < 1.0, (name, r)
        assert r["step_ms"] > 0 and r["compute_ms"] > 0 and r["aggregate_ms"] > 0
        assert 0.0 <= r["overlap_fraction"] <= 1.0, (name, r)
        assert r["untouched"], f"{name}: measuring changed the run's aggregator state"
