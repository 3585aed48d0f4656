"""`wrap_optimizer`: plain `model.compile` + `model.fit` under MirroredStrategy use the
aggregator (and nothing else changes for Keras). The child: tests/keras_hook_child.py."""

import os
import sys

import pytest

from subproc import ROOT, last_json_line, run

CHILD = os.path.join(ROOT, "tests", "keras_hook_child.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keras")
    return last_json_line(run([sys.executable, CHILD, str(tmp)], timeout=240).stdout)


def test_fit_calls_the_aggregator_and_keeps_the_optimizer_a_plain_adam(results):
    h = results["hook"]
    # If a Keras upgrade stops routing gradients through _all_reduce_sum_gradients, this fails.
    assert h["traced"] >= 1 and h["steps"] == 8
    assert h["is_adam"] and h["has_agg"] and h["config_same"]
    assert h["roundtrip"] == "Adam" and h["reloaded"] == "Adam"
    assert any("residual" in k for k in h["ckpt_keys"]), h["ckpt_keys"]


def test_keras_applies_what_the_aggregator_returns(results):
    assert results["zeros"]["traced"] >= 1
    assert results["zeros"]["unchanged"]


def test_gradient_accumulation_matches_the_larger_batch(results):
    a = results["accum"]
    assert a["moved"] > 1e-2
    assert a["max_diff"] < 1e-5, a


def test_loss_scale_optimizer_mixed_float16(results):
    r = results["lso"]
    assert r["traced"] >= 1 and r["same"]
    assert r["loss"][-1] < 0.5 * r["loss"][0]


def test_single_replica_skips_the_aggregator(results):
    assert results["single"]["traced"] == 0
