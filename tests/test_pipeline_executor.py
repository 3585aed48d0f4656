"""Pipeline executor and PipelineModel against the single-device model.

Each child process (tests/pipeline_executor_child.py) splits the CPU into K logical devices
first, then runs many checks and prints one JSON line; the tests below read it (one
TensorFlow start-up per K).
"""

import os
import sys

import pytest

from subproc import ROOT, last_json_line, outcome, run, run_concurrently

CHILD = os.path.join(ROOT, "tests", "pipeline_executor_child.py")


def _run(K, timeout=400):  # a hang's bound: the K=2 child took over 150 s under load
    return last_json_line(run([sys.executable, CHILD, str(K)], timeout=timeout).stdout)


@pytest.fixture(scope="module")
def children():
    """The K=2 and K=4 children at the same time: [K=2's out, K=4's out], each the
    AssertionError its child failed with if it failed."""
    return run_concurrently([lambda: _run(2), lambda: _run(4)], keep_failures=True)


@pytest.fixture(scope="module")
def k2(children):
    return outcome(children[0])


@pytest.fixture(scope="module")
def k4(children):
    return outcome(children[1])


# SGD with K=2 only (the child says why); Adam with K=2 and 4.
@pytest.mark.parametrize("K,opt,tol", [(2, "sgd", 1e-6), (2, "adam", 1e-5), (4, "adam", 1e-5)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb_h1"])
def test_weights_after_3_steps_equal_single_device(k2, k4, K, schedule, opt, tol):
    assert {2: k2, 4: k4}[K][f"{opt}/{schedule}"] < tol


def test_residual_model_and_recompute_match_single_device(k2):
    assert k2["residual/adam/1f1b"] < 1e-5
    assert k2["recompute/adam/1f1b"] < 1e-5
    assert k2["residual/adam/zb_h1"] < 1e-5
    assert k2["zb_recompute_error"].startswith("ConfigError: recompute=True is invalid")


def test_partition_places_and_balances_stages(k2):
    assert k2["stage_layers"] == [2, 2]  # 3 equal Dense + a smaller head: 2 | 2
    assert k2["stage_devices"] == [["CPU:0"], ["CPU:1"]]


def test_models_that_cannot_be_cut_are_named(k2):
    assert k2["branch_error"].startswith("TfparError: model 'residual' can be cut into at most 5 stages, not 6")
    assert "feeds 'add" in k2["branch_error"]
    assert k2["too_many_stages"].startswith("ConfigError: pipeline_stages=4 is invalid: "
                                            "model 'mlp' has 3 layers")


def test_fit_loss_falls_and_weights_round_trip(k2):
    loss = k2["fit_loss"]
    assert loss[-1] < 0.6 * loss[0], loss
    assert k2["evaluate"][0] < loss[0]
    assert k2["iterations"] == 4 * 512 // 32
    assert k2["reload_diff"] == 0.0 and k2["keras_file_diff"] == 0.0
    assert k2["reload_devices"] == [["CPU:0"], ["CPU:1"]]


def test_batches_that_do_not_split_give_clear_errors(k2):
    assert k2["fit_batch_error"].startswith("ConfigError: microbatches=4 is invalid")
    assert "batch_size=16 over 42 examples gives a batch of 10" in k2["fit_batch_error"]
    assert "must divide the batch size 10" in k2["static_batch_error"]
    assert "microbatches=4 must divide the batch size" in k2["dataset_batch_error"]
    assert k2["interleaved_error"].startswith("ConfigError: microbatches=3 is invalid")


def test_stages_overlap_in_the_traced_graph(k2):
    # No path between concurrent actions of different stages; the serialised variant has one.
    assert k2["overlap_dependency"] == [False, True]
    # Only variable ops, the optimizer's and the batch-size Assert are stateful: nothing
    # that automatic control dependencies would chain across stages.
    assert set(k2["stateful_ops"]) <= {"Assert", "Placeholder", "ResourceApplyAdam", "NoOp"}, \
        k2["stateful_ops"]


def test_one_op_at_a_time_is_exact_and_chains_each_stage(k2):
    for schedule, (diff, edges) in k2["one_op"].items():
        assert diff < 1e-6, (schedule, diff)
    assert k2["one_op"]["1f1b"][1] > 2 * k2["one_op_edges_without"], k2


def test_built_from_a_parallel_config(k2):
    assert k2["from_config"] == [4, "interleaved", 4, 2]  # K*V stage models
