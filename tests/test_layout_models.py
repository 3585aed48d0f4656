"""Any model Keras can build, KerasHub's included, under Keras's own `ModelParallel` on a
2×2 mesh of logical CPUs (after `tfpar.layout.enable()`), equal to the same Keras calls on
one device (same seed, same data).

Two children at once (`tests/layout_models_child.py`): users' models (dict inputs and
two named outputs with their own losses, loss weights, built-in and custom metrics,
per-output sample weights, an activity and a kernel regularizer; `class_weight`;
`Embedding(mask_zero=True)` into LSTM and GRU on a list of inputs; a subclassed model with
its own `train_step`), and KerasHub (Gemma, Llama, BERT backbones with a head,
`GPT2CausalLM`, a preset saved and loaded). Each compares the weights after `fit`, the
`History`, and where asked `evaluate` and `predict`, within 1e-5 (a weight's difference
relative to its largest magnitude where that is above 1: with two layers Llama's embedding
grew to 3.3 in 3 steps and differed by 1.1e-5, float32 rounding in sums taken in another
order; the KerasHub models now have one layer each, see the child).
KerasHub's GPT-2 and BERT keep their default dropout (0.1): the mesh draws one device's
masks (tfpar.layout.rng; without it GPT-2 was off by 0.21 after 2 steps).

The optimizer is Adam where the model has no embedding, SGD where it has one: on one
device TensorFlow hands Adam an embedding's gradient as `IndexedSlices` and Keras squares
each slice before duplicates are summed (tests/test_layout_exact.py), which the mesh's
dense gradient does not.
Both children run with grappler off (tests/graph_optimizer.py), the one-device runs too.
"""

import os
import sys

import pytest

import cases as cases_lib
from graph_optimizer import OFF as GRAPPLER_OFF
from subproc import ROOT, last_json_line, run

EXACT = 1e-5
CHILDREN = [["structures", "sequence", "custom_step"], ["hub"]]


def _child(names):
    out = run([sys.executable, os.path.join(ROOT, "tests", "layout_models_child.py"),
               ",".join(names)], timeout=900, env=GRAPPLER_OFF)
    result = last_json_line(out.stdout)
    assert result["grappler"] == "off", result["grappler"]  # as asked, both sides alike
    return result


@pytest.fixture(scope="module")
def cases():
    """{case: its JSON, or the AssertionError its child failed with}."""
    return cases_lib.gather(CHILDREN, _child)


def _case(cases, name):
    return cases_lib.case(cases, name, "layout_models_child.py")


def _assert_exact(run_, label):
    assert run_["on_mesh"] and run_["sharded"], label
    assert run_["keys"] == run_["single_keys"], label
    for what, diff in run_["diffs"].items():
        assert diff <= EXACT, f"{label}: {what} differs by {diff}"


def test_dict_inputs_two_outputs_losses_weights_and_any_metric(cases):
    result = _case(cases, "structures")
    run_ = result["two_heads"]
    _assert_exact(run_, "two heads")
    assert set(run_["diffs"]) == {"weights", "history", "evaluate", "predict"}
    assert run_["keys"] == ["label_accuracy", "label_agreement", "label_loss", "loss",
                            "score_loss", "score_mae", "score_root_mean_squared_error"]
    assert run_["evaluate_keys"] == run_["keys"]
    assert run_["predict_structure"] == {"label": [32, 4], "score": [32, 1]}
    assert run_["sharded"] == ["mix/kernel", "up/bias", "up/kernel"]
    _assert_exact(result["class_weight"], "class_weight")


def test_masked_embedding_lstm_gru_and_list_inputs(cases):
    result = _case(cases, "sequence")
    _assert_exact(result["lstm_gru"], "lstm/gru")
    assert result["lstm_gru"]["predict_structure"] == [32, 3]
    refused = result["while_loop_rnn"]
    assert refused.startswith("ConfigError: lstm.unroll=False"), refused
    assert "unroll=True" in refused and "\n" not in refused


def test_a_models_own_train_step_runs_inside_the_mesh_step(cases):
    run_ = _case(cases, "custom_step")["own_train_step"]
    _assert_exact(run_, "own train_step")
    assert run_["keys"] == ["accuracy", "loss", "own_loss"]  # its own tracked metric
    assert run_["sharded"] == ["own/head/kernel", "own/up/kernel"]  # built by fit
    refused = _case(cases, "custom_step")["own_train_step_fp16"]
    assert refused.startswith("ConfigError: mixed_precision='fp16'"), refused
    assert "own train_step" in refused and "\n" not in refused


@pytest.mark.parametrize("name", ["gemma", "llama", "bert", "gpt2_causal_lm"])
def test_keras_hub_models_fit_on_their_dict_inputs(cases, name):
    run_ = _case(cases, "hub")[name]
    _assert_exact(run_, name)
    if name in ("gemma", "llama"):  # their own get_layout_map: weights split over batch too
        assert "token_embedding/embeddings" in run_["sharded"]


def test_a_keras_hub_preset_loads_onto_the_mesh(cases):
    loaded = _case(cases, "hub")["preset"]
    assert loaded["plain_load_diff"] == 0.0  # the saved preset, loaded on one device
    # from_preset loads with Keras's load_weights, which writes to the mesh's variables
    # by their layouts (tfpar.layout.keras_state)
    assert "error" not in loaded, loaded
    assert loaded["on_mesh"] and loaded["load_diff"] == 0.0
