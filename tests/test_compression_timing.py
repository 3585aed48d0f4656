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
