"""`fit` / `evaluate` / `predict` on a mesh, checkpoints across meshes, the train entry.

One child process (4 logical CPUs): a transformer (one block: every layer kind and layout
rule; a second block repeats them) trained on a 2×2 mesh is saved, restored onto 1×4 and
onto a plain single-device model (exactly), and training continues on 1×4 as it would have
on 2×2. The same child then runs the `python -m tfpar.train`
command line (`tfpar.train.run()`, in-process: one TensorFlow start for everything) and
resumes a run of the train entry from its checkpoint (child: tests/layout_fit_child.py).
"""

import os
import sys

import pytest

from subproc import ROOT, last_json_line, run, run_module

CHILD = os.path.join(ROOT, "tests", "layout_fit_child.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("layout_fit"))
    out = run([sys.executable, CHILD, directory], timeout=400)
    found = last_json_line(out.stdout)
    found["dir"] = directory
    found["stdout"] = out.stdout
    return found


def test_fit_lowers_the_loss_and_evaluate_agrees(result):
    losses = result["history"]["loss"]
    assert len(losses) == 4
    assert losses[-1] < 0.8 * losses[0], losses
    assert result["eval_after"]["loss"] < 0.8 * result["eval_before"]["loss"]
    assert result["eval_after"]["accuracy"] > result["eval_before"]["accuracy"]


def test_keras_loops_and_run_eagerly_are_refused_clearly(result):
    assert "model.fit cannot run" in result["keras_fit_refused"]
    assert "MeshTrainer's fit" in result["keras_fit_refused"]
    assert "run_eagerly cannot work on a DTensor mesh" in result["run_eagerly_refused"]


def test_checkpoint_restores_across_meshes_exactly(result):
    assert result["restore_1x4"] == 0.0
    assert result["restore_plain"] == 0.0
    assert result["plain_is_plain"]
    assert result["continue_2x2_vs_1x4"] <= 1e-5
    assert result["weights_1x4_to_2x2"] == 0.0


def test_predict_matches_the_single_device_model(result):
    assert result["predict_vs_plain"] <= 1e-5


def test_cli_runs_tensor_parallel_and_writes_the_metrics_json(result):
    # `python -m tfpar.train --tensor_parallel=2 --data_parallel=2 --cpu_devices=4`, run
    # inside the fixture's child (tfpar.train.run(): the same flags, config and main).
    assert result["cli_exit"] in (0, None)
    line = [l for l in result["stdout"].splitlines() if l.startswith("tfpar: strategy=")]
    assert len(line) == 1 and "strategy=DTensorMesh" in line[0], result["stdout"][-2000:]
    train = result["train"]
    assert train["steps"] == 24 and train["mesh"] == {"data_parallel": 2,
                                                      "tensor_parallel": 2}
    assert train["strategy"] == "DTensorMesh"
    assert train["loss_history"][-1] < train["loss_history"][0]
    # 17 classes do not split over 2: embedding and head stay whole, the rest is halved.
    assert len(train["memory"]["params_per_device"]) == 4
    # the JSON holds the losses the command printed
    assert (f"loss {train['loss_history'][0]:.4f} -> {train['final_loss']:.4f}"
            in line[0]), (line, train["final_loss"])


def test_train_entry_resumes_from_its_checkpoint_exactly(result):
    assert result["resumed_from_step"] == 12 and result["resumed_steps"] == 12
    # The same mesh, weights, slots and data position: the same losses, bit for bit.
    assert result["resume_vs_uninterrupted"] == 0


def test_cli_refuses_degrees_that_do_not_match_the_devices():
    out = run_module("tfpar.train", "--model=transformer", "--tensor_parallel=2",
                     "--data_parallel=3", "--cpu_devices=4", "--steps=2", check=False,
                     timeout=120)
    assert out.returncode == 2
    assert "data_parallel=3" in out.stderr and "--cpu_devices=6" in out.stderr
