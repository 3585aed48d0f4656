"""Keras's state API on a model laid out by `keras.distribution` on TensorFlow, with the
user's own functional model and Keras's own calls: `get_weights`, `set_weights`,
`variable.assign`, `numpy()`, `save_weights`/`load_weights`, `save`/`load_model`,
`summary`, callbacks in `evaluate`/`predict`, `ModelCheckpoint`, `BackupAndRestore`; and a
model saved on a 2×2 mesh, or compiled with `tfpar.DistributedOptimizer`, loaded by stock
Keras in a process that never imports tfpar.

One child on 4 logical CPUs (tests/layout_keras_state_child.py) does the mesh side and
writes the files; a second (tests/keras_stock_load_child.py, plain Keras) loads them.
"""

import os
import sys

import pytest

import subproc
from subproc import ROOT, last_json_line

# A prediction of the same weights on another mesh or one device sums in another order.
PREDICT = 1e-5
UP = "up/kernel"  # (32, 64): columns over `model`


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("keras_state"))
    mesh = last_json_line(subproc.run(
        [sys.executable, os.path.join(ROOT, "tests", "layout_keras_state_child.py"), folder],
        timeout=600).stdout)
    stock = last_json_line(subproc.run(
        [sys.executable, os.path.join(ROOT, "tests", "keras_stock_load_child.py"), folder],
        timeout=300).stdout)
    return mesh, stock


def _case(runs, name):
    result = runs[0][name]
    if "error" in result:
        raise AssertionError(f"layout_keras_state_child.py case {name} raised:\n"
                             f"{result['error']}")
    return result


@pytest.fixture(scope="module")
def saved(runs):
    return _case(runs, "save_and_load")


def test_weights_are_read_whole_and_written_by_their_layout(saved):
    api = saved["weights_api"]
    assert api["set_get_roundtrip"]  # set_weights then get_weights: the same arrays
    # after set_weights each device holds the 32 columns of up/kernel its coordinate owns
    assert api["shards_follow_layout"] and api["shard_shape"] == [32, 32]
    assert api["assign_sharded"] and api["assign_replicated"]
    # 32·64+64 + 64·32+32 + 32·10+10
    assert api["summary_trainable"] == ["Trainable params: 4,522 (17.66 KB)"]


def test_a_weights_file_from_a_2x2_mesh_loads_onto_1x4_and_one_device(saved, runs):
    assert saved["specs_2x2"][UP] == [["unsharded", "model"], [32, 32]]
    on_1x4, single = saved["weights_file_on_1x4"], saved["weights_file_on_single"]
    assert on_1x4["on_mesh"] and on_1x4["specs"][UP] == [["unsharded", "model"], [32, 16]]
    assert not single["on_mesh"]
    for run in (on_1x4, single):
        assert run["bit_equal"] and run["optimizer_state_equal"]
        assert run["predict_diff"] <= PREDICT
    assert runs[1]["mesh22_weights_file_bit_equal"]  # stock Keras, a model of its own
    data_parallel = saved["weights_file_on_data_parallel"]
    assert data_parallel["bit_equal"]
    assert data_parallel["specs"][UP] == [["unsharded", "unsharded"], [32, 64]]
    assert saved["assign_from_another_mesh"]  # a DataParallel weight from a 2×2 one


def test_load_model_lays_out_by_the_current_map_or_gives_a_plain_model(saved):
    on_1x4, single = saved["load_model_1x4"], saved["load_model_single"]
    assert on_1x4["on_mesh"] and on_1x4["specs"][UP] == [["unsharded", "model"], [32, 16]]
    assert on_1x4["specs"]["down/kernel"] == [["model", "unsharded"], [16, 32]]
    assert not single["on_mesh"] and single["specs"] == {}
    for run in (on_1x4, single):
        assert run["bit_equal"] and run["optimizer"] == "Adam"
        assert run["optimizer_state_equal"]  # Adam's step count and slots
        assert run["predict_diff"] <= PREDICT
    # loaded on its mesh, one more epoch equals one more epoch of the model that was saved
    assert saved["resumed_after_load_model_bit_equal"] and saved["resumed_iterations"] == 8


@pytest.fixture(scope="module")
def callbacks(runs):
    return _case(runs, "callbacks")


def test_callbacks_in_evaluate_and_predict(callbacks):
    run = callbacks["evaluate_predict"]
    assert run["calls"] == (["test_begin"] + [f"test_batch_{i}" for i in range(4)]
                            + [f"predict_batch_{i}" for i in range(4)])
    assert run["test_end_equals_result"] and run["outputs_are_the_predictions"]


def test_model_checkpoint_in_fit_on_the_mesh(callbacks):
    run = callbacks["model_checkpoint"]
    assert run["files"] == ["e1.keras", "e1.weights.h5", "e2.keras", "e2.weights.h5"]
    # epoch 1's file, loaded onto 1×4, holds the weights a callback read after epoch 1
    assert run["epoch_1_weights_bit_equal"] and run["epoch_2_model_bit_equal"]


def test_backup_and_restore_resumes_as_the_uninterrupted_run(callbacks):
    run = callbacks["backup_and_restore"]
    assert callbacks["interrupted"]
    assert run["epochs_run"] == [2, 3] and run["history_epochs"] == 2
    assert run["iterations"] == 16  # 4 epochs of 4 batches
    assert run["bit_equal_to_uninterrupted"]


def test_a_distributed_optimizer_model_loads_in_stock_keras_without_tfpar(runs):
    saving = _case(runs, "distributed_optimizer")
    assert saving == {"optimizer_class": "Adam", "aggregator": "PowerSGDAggregator"}
    stock = runs[1]
    assert stock["tfpar_imported"] == []
    loaded = stock["distributed"]
    assert loaded["optimizer"] == "keras.src.optimizers.adam.Adam"
    assert loaded["state_equal"] and loaded["predict_diff"] <= PREDICT
    assert stock["mesh22_model"]["bit_equal"]
    assert stock["mesh22_model"]["predict_diff"] <= PREDICT


def test_repeated_keras_paths_name_their_codec_state_apart():
    # Two nested models' Dense "proj" both have Keras path `proj/kernel`: their codec
    # state (residuals, Qs) was stored under one name, one weight's overwriting the
    # other's in Keras's files and tfpar's checkpoints (a review's probe: after
    # save_weights -> another epoch -> load_weights the first proj's residual stayed
    # 0.085 off what was saved). Named apart in the model's order now.
    from types import SimpleNamespace

    from tfpar.layout.reduction import distinct_paths

    paths = ["proj/kernel", "proj/bias", "proj/kernel", "proj/bias", "proj/kernel", "head"]
    assert distinct_paths([SimpleNamespace(path=p) for p in paths]) == [
        "proj/kernel", "proj/bias", "proj/kernel#2", "proj/bias#2", "proj/kernel#3", "head"]
