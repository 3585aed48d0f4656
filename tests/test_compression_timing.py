"""`measure_comm_fraction`: it measures without touching the run's own aggregator state, and
its communication share is large where a planted collective is slow and small where the
compute is (bounds a wrong formula or a swapped timing would break; the unclamped values
are asserted, not the [0, 1] clamp the function applies)."""

import json
import sys

from subproc import ROOT, last_json_line, run, run_python

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
        assert r["step_ms"] > 0 and r["compute_ms"] > 0 and r["aggregate_ms"] > 0
        assert r["untouched"], f"{name}: measuring changed the run's aggregator state"


def test_comm_share_is_high_for_a_slow_collective_and_low_for_slow_compute():
    # tests/comm_share_child.py plants 0.3 s of sleep in the all-reduce (one bucket, so
    # nothing can hide behind the backward pass) or in the forward pass of a model with a
    # few dozen parameters. Either sleep dwarfs the rest of the step (a few ms here, tens
    # under heavy load), so the share is ~0.9+ in the first case and ~0.1- in the second.
    out = last_json_line(run([sys.executable, f"{ROOT}/tests/comm_share_child.py"],
                             timeout=300).stdout)
    print(json.dumps(out))
    slow, quick = out["slow_collective"], out["slow_compute"]
    assert slow["comm_fraction_unclamped"] > 0.6, slow
    assert slow["aggregate_ms"] >= 300, slow   # the sleep is inside what "aggregate" times
    assert slow["overlap_fraction_unclamped"] < 0.5, slow  # one bucket: nothing hides
    assert quick["comm_fraction_unclamped"] < 0.3, quick
    assert quick["compute_ms"] >= 300, quick
    # The clamped values (the metrics JSON's) follow the measured ones.
    assert slow["fraction"] == min(1.0, max(0.0, slow["comm_fraction_unclamped"]))
