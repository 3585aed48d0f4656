"""`measure_comm_fraction`: it measures without touching the run's own aggregator state, and
its communication share is large where a planted collective is slow and small where the
compute is (bounds a wrong formula or a swapped timing would break; the unclamped values
are asserted, not the [0, 1] clamp the function applies)."""

import json
import sys

import pytest

from subproc import ROOT, last_json_line, run


@pytest.fixture(scope="module")
def measured():
    """tests/comm_share_child.py's report: the planted cases and the aggregators' runs
    (MirroredStrategy over 2 logical CPUs)."""
    out = last_json_line(run([sys.executable, f"{ROOT}/tests/comm_share_child.py"],
                             timeout=300).stdout)
    print(json.dumps(out))
    return out


def test_comm_fraction_per_aggregator_leaves_state_alone(measured):
    for name, r in measured["aggregators"].items():
        assert r["step_ms"] > 0 and r["compute_ms"] > 0 and r["aggregate_ms"] > 0
        assert r["untouched"], f"{name}: measuring changed the run's aggregator state"
    assert sorted(measured["aggregators"]) == ["none", "powersgd", "topk"]


def test_comm_share_is_high_for_a_slow_collective_and_low_for_slow_compute(measured):
    # tests/comm_share_child.py plants 0.6 s of sleep in the all-reduce (one bucket, so
    # nothing can hide behind the backward pass) or in the forward pass of a model with a
    # few dozen parameters. Either sleep dwarfs the rest of the step (a few ms here, tens
    # under heavy load), so the share is ~0.9+ in the first case and ~0.1- in the second.
    slow, quick = measured["slow_collective"], measured["slow_compute"]
    assert slow["comm_fraction_unclamped"] > 0.6, slow
    assert slow["aggregate_ms"] >= 600, slow   # the sleep is inside what "aggregate" times
    assert slow["overlap_fraction_unclamped"] < 0.5, slow  # one bucket: nothing hides
    assert quick["comm_fraction_unclamped"] < 0.3, quick
    assert quick["compute_ms"] >= 600, quick
    # The clamped values (the metrics JSON's) follow the measured ones.
    assert slow["fraction"] == min(1.0, max(0.0, slow["comm_fraction_unclamped"]))


def _steps(agg, grad, variable, n):
    import tensorflow as tf
    for _ in range(n):
        agg.all_reduce_sum([tf.constant(grad)], [variable])
    return int(agg.wire_bytes.numpy())


def _planted(shape=(64, 32), rank=2, seed=0):
    import numpy as np
    rng = np.random.RandomState(seed)
    u, _ = np.linalg.qr(rng.randn(shape[0], rank))
    v, _ = np.linalg.qr(rng.randn(shape[1], rank))
    return (u @ np.diag(np.arange(rank, 0, -1.0)) @ v.T + 1e-3 * rng.randn(*shape)).astype(
        "float32")


def test_scratch_copy_times_the_path_the_run_reached():
    """No strategy, one replica, in process. The copy `measure_comm_fraction` times sends
    what the run sends now: PowerSGD with Adam in front past the exact warm-up (a fresh copy
    would start it again: fp32 bytes), and `auto` at the rank it planned (2, where a fresh
    copy starts at the layer's largest, 16); timing the copy leaves the run's step alone."""
    import numpy as np
    import tensorflow as tf

    from tfpar.compression import AutoAggregator, PowerSGDAggregator
    from tfpar.compression.timing import _scratch_copy

    g = _planted()
    fp32 = 4 * g.size
    psgd = PowerSGDAggregator(rank=2, adam=(0.9, 0.999, 1e-7), adam_warmup_steps=3,
                              adam_variance="local_debiased")
    auto = AutoAggregator(budget_ms=1.0, link=(1e3, 0.0), window=2, eta=10.0, start_step=3)
    variables = {}
    for agg in (psgd, auto):
        v = variables[agg] = tf.Variable(tf.zeros(g.shape))
        agg.build([v])
        sent = _steps(agg, g, v, 4)  # 3 exact steps, then one compressed
        assert sent < fp32 / 4, (type(agg).__name__, sent)
        step = int(agg.step.numpy())
        copy = _scratch_copy(agg, [v])
        timed = _steps(copy, g, v, 2)
        assert timed == sent, (type(agg).__name__, timed, sent)
        assert int(agg.step.numpy()) == step
    assert auto.rank_of(0) == 2 and auto.r_max[0] == 16
    out = psgd.all_reduce_sum([tf.constant(g)], [variables[psgd]])[0]  # the run goes on
    assert np.all(np.isfinite(out.numpy()))


def test_scratch_copy_under_a_strategy_times_the_compressed_path():
    """tests/scratch_copy_child.py (2 replicas, Adam in front): for PowerSGD, top-k and
    `auto` the copy's step puts the run's bytes on the wire, below fp32's (before, each
    copy ran Adam's exact warm-up again: fp32's bytes), and the run's step count stays."""
    out = last_json_line(run([sys.executable, f"{ROOT}/tests/scratch_copy_child.py"],
                             timeout=240).stdout)
    print(json.dumps(out))
    for name in ("powersgd", "topk", "auto"):
        r = out[name]
        assert r["copy"] == r["run"] < out["fp32"], (name, r)
        assert r["run_step_before"] == r["run_step_after"] == 5, (name, r)
