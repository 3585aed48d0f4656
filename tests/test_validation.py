"""`validation_steps`: held-out data of the same task, evaluated at every epoch end on every
backend; the metrics JSON's `validation` block and `val_loss` in Keras callbacks' logs."""

import json
import os
import sys

import pytest

from subproc import ROOT, last_json_line, outcome, run

BASE = {"steps": 40, "steps_per_epoch": 10, "validation_steps": 3, "verbose": 0,
        "global_batch_size": 32, "learning_rate": 3e-3}
RUNS = {
    "data_parallel": {"cpu_devices": 2},
    "pipeline": {"cpu_devices": 2, "pipeline_stages": 2, "microbatches": 2},
    "dtensor": {"cpu_devices": 2, "model": "transformer", "tensor_parallel": 2,
                "global_batch_size": 16, "steps": 30},
    "tf_keras": {"cpu_devices": 2, "keras": 2},
}


# A user dataset module without `<function>_validation`, asked for validation_steps.
REFUSED = ["--dataset=user_data:sign_of_sum_nan_at_step_3", "--num_classes=2",
           "--validation_steps=2"]


def _fork_result(case):
    """A fork's JSON line, or the AssertionError its failure gives."""
    if case["returncode"] != 0:
        return AssertionError(f"exit {case['returncode']}\n--- stdout\n"
                              f"{case['stdout'][-3000:]}\n--- stderr\n{case['stderr'][-5000:]}")
    return last_json_line(case["stdout"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each backend's run and the refused command line, forked from one child
    (tests/validation_child.py: one TensorFlow import), two at a time: {backend: its JSON,
    or the AssertionError of its failed fork; "refused": that fork's result}."""
    folder = tmp_path_factory.mktemp("validation")
    cases = [{"config": {**BASE, **RUNS[b]}} for b in RUNS] + [{"argv": REFUSED}]
    out = run([sys.executable, os.path.join(ROOT, "tests", "validation_child.py"),
               json.dumps(cases), str(folder)],
              env={"PYTHONPATH": os.path.join(ROOT, "tests")}, timeout=400)
    results = last_json_line(out.stdout)["cases"]
    return {**{b: _fork_result(r) for b, r in zip(RUNS, results)}, "refused": results[-1]}


@pytest.mark.parametrize("backend", list(RUNS))
def test_validation_loss_falls_and_reaches_callbacks(trained, backend):
    config = {**BASE, **RUNS[backend]}
    out = outcome(trained[backend])
    assert out["backend"] == backend
    validation = out["validation"]
    epochs = config["steps"] // config["steps_per_epoch"]
    assert set(validation) >= {"loss", "accuracy"}
    assert len(validation["loss_history"]) == epochs
    assert validation["at_steps"] == [config["steps_per_epoch"] * (i + 1) for i in range(epochs)]
    # Training helps on examples it never saw.
    assert validation["loss_history"][-1] < validation["loss_history"][0]
    assert 0.0 <= validation["accuracy"] <= 1.0
    # The user's callback got the same val_loss the metrics report, every epoch.
    assert out["seen_val_loss"] == pytest.approx(validation["loss_history"], rel=1e-6)
    if "evaluate_again" in out:  # the same held-out batches at every evaluation
        assert out["evaluate_again"] == pytest.approx(validation["loss"], rel=1e-5)


def test_a_user_dataset_without_held_out_batches_is_refused_naming_what_to_define(trained):
    # (A module with `<function>_validation` gives its own held-out batches:
    # tests/test_train.py's user-dataset run, which trains with --validation_steps=2.)
    # A module without `<function>_validation` is refused with what to define.
    out = trained["refused"]
    assert out["returncode"] == 2, out
    error = out["stderr"].strip().splitlines()[-1]
    assert error.startswith("tfpar: error: validation_steps=2 is invalid")
    assert "user_data.sign_of_sum_nan_at_step_3_validation(input_context, config)" in error
