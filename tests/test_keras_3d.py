"""dp × tp × pp (2 × 2 × 2, 8 logical CPUs) from a user's own `model.fit`: a Keras
`DeviceMesh` `("stage", "batch", "model")` under `tfpar.layout.enable()`
(`tfpar.layout.keras_pipeline`), against the same model fitted on one device, and with a
`tfpar.DistributedOptimizer`'s PowerSGD, also under `mixed_float16`; Adam's state
through `model.save`/`load_model` and Keras's `BackupAndRestore`, and a codec's state
(top-k, PowerSGD, Adam in front) through Keras's files; what the cut must not
drop or break (skipped steps counted, a layer assigning its own state, a layer's own
metric, a trainable weight assigned in call, variables held by no layer, unnamed weights,
inference-mode evaluation); the CLI's 3D trainer against the same settings through a
user's `fit`. Three children, two at a time (tests/keras_3d_child.py), then the CLI's runs
(tests/train_configs_child.py) beside that child's `cli` case.

The child of the codec files' case (`codec_files`: top-k, PowerSGD and Adam in front
through Keras's files) runs with grappler off (tests/graph_optimizer.py): each of its
comparisons is a codec's run against the same codec's uninterrupted run in that child, and
its cost is the first call of each new model's step (less with grappler off:
docs/benchmarks/suite.md). Codecs on the pipeline mesh keep runs with TensorFlow's default
optimizer in the other children: PowerSGD (exact at its limit, rank 1 under fp16), Adam in
front of PowerSGD in the CLI comparison, and a codec's state through Keras's files
(`codec_nested`: PowerSGD through `BackupAndRestore`, `save_weights`/`load_weights` and
`load_model`); tests/test_mesh_codec_compose.py: top-k on dp×tp×pp.
"""

import json
import os
import sys

import numpy as np
import pytest

import cases as cases_lib
import keras_codec_files
from graph_optimizer import OFF as GRAPPLER_OFF
from subproc import ROOT, last_json_line, run, run_concurrently
from test_layout_compose import train_configs
from test_train import weights

CHILD = os.path.join(ROOT, "tests", "keras_3d_child.py")
TOLERANCE = {"sgd": 1e-6, "adam": 1e-5}
# `python -m tfpar.train --model=mlp --data_parallel=2 --tensor_parallel=2
# --pipeline_stages=2 --microbatches=2 ...` (as `train(config)`): Adam; the check
# `--compression=powersgd --mixed_precision=fp16` (SGD); Adam in front of PowerSGD (2
# exact steps, 3 compressed)
CLI_BASE = {"model": "mlp", "steps": 4, "steps_per_epoch": 4, "global_batch_size": 32,
            "cpu_devices": 8, "data_parallel": 2, "tensor_parallel": 2,
            "pipeline_stages": 2, "microbatches": 2, "schedule": "1f1b", "verbose": 0}
CLI_3D = [{**CLI_BASE, "optimizer": "adam", "learning_rate": 1e-3},
          {**CLI_BASE, "optimizer": "sgd", "learning_rate": 0.05,
           "compression": "powersgd", "mixed_precision": "fp16"},
          {**CLI_BASE, "optimizer": "adam", "learning_rate": 1e-3, "steps": 5,
           "steps_per_epoch": 5, "compression": "powersgd", "adam_warmup_steps": 2}]


# The cases whose child runs with grappler off (the module's docstring); `codec_nested`
# (PowerSGD's state through BackupAndRestore, save_weights/load_weights and load_model)
# keeps a codec's Keras files with TensorFlow's default optimizer.
GRAPPLER_OFF_CASES = ["codec_files"]


@pytest.fixture(scope="module")
def results():
    # two children at a time: the longest (about a third of the file's CPU) first, beside
    # the other two in turn
    return cases_lib.gather([GRAPPLER_OFF_CASES, ["exact", "powersgd", "state", "refusals"],
                             ["resume", "guards", "slots", "codec_nested"]], _child)


def _child(names):
    off = names == GRAPPLER_OFF_CASES
    out = last_json_line(run([sys.executable, CHILD, ",".join(names)], timeout=900,
                             env=GRAPPLER_OFF if off else None).stdout)
    assert out["grappler"] == ("off" if off else "default"), out["grappler"]  # as asked
    return out


def _case(results, name):
    return cases_lib.case(results, name, "keras_3d_child.py")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_3d_fit_equals_one_device(results, optimizer):
    run_ = _case(results, "exact")[optimizer]
    tolerance = TOLERANCE[optimizer]
    assert run_["weights"] <= tolerance, run_
    assert run_["loss"] <= tolerance, run_
    assert run_["evaluate"] <= tolerance and run_["predict"] <= tolerance, run_
    # two stages, each tensor-parallel: the layout map's kernels split over `model`
    assert all(run_["stage_layers"]) and len(run_["stage_layers"]) == 2, run_
    shards = run_["kernel_shards"]
    assert shards["up1/kernel"] == [12, 32] and shards["down1/kernel"] == [32, 64], shards
    assert shards["head/kernel"] == [16, 10], shards
    # a callback gets the user's model, holding the trained weights at the epoch's end
    assert run_["callback_model_is_the_users"] and run_["callback_weights"] <= tolerance, run_


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_save_weights_loads_on_one_device_and_load_weights_reaches_the_stages(
        results, optimizer):
    run_ = _case(results, "exact")[optimizer]
    assert run_["saved"] <= TOLERANCE[optimizer], run_
    assert run_["loaded_evaluate"] <= 1e-6, run_


def test_powersgd_at_its_limit_equals_the_uncompressed_run(results):
    runs = _case(results, "powersgd")
    full, factored = runs["full_rank"], runs["rank_16_sgd"]
    # Adam, every matrix whole; SGD, the 64 x 64 kernels as exact rank-16 factors: the
    # 2.3e-6 measured (2026-12-05) is float32 rounding of the factors' orthogonalisation
    assert full["diff"] <= 1e-5, full
    assert factored["diff"] <= 1e-5, factored
    for run_ in (full, factored):
        assert np.allclose(run_["loss"], run_["reference_loss"], atol=1e-5), run_
        assert len(run_["state"]["bytes"]) == 2, run_["state"]  # a reduction per stage
    assert all(stats["bytes_on_wire_per_step"] < stats["bytes_uncompressed_per_step"]
               for stats in factored["state"]["bytes"]), factored["state"]  # factors sent
    # a step with non-finite gradients is never applied (fp32 too): the weights stay
    assert factored["nan_step_kept"] == 0.0, factored


def test_powersgd_rank_1_trains_under_mixed_float16(results):
    run_ = _case(results, "powersgd")["fp16_rank_1"]
    assert run_["optimizer"] == "LossScaleOptimizer", run_["optimizer"]
    losses = run_["losses"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.85 * losses[0], losses
    state = run_["state"]
    assert len(state["bytes"]) == 2, state  # one reduction per stage
    for stats in state["bytes"]:
        assert stats["bytes_on_wire_per_step"] < stats["bytes_uncompressed_per_step"] / 2
    assert any(name.endswith("/powersgd_q") for name in state["names"]), state["names"]
    assert state["max_abs"] > 0, state  # residuals and Qs were written: the codec ran


def test_an_fp16_overflow_skips_the_step_on_every_stage(results):
    run_ = _case(results, "powersgd")["fp16_rank_1"]
    assert run_["weights_kept"] == [0.0, 0.0], run_["weights_kept"]
    for before, after in run_["scales"]:
        assert after == before / 2, run_["scales"]
    assert run_["finite"]
    # the model's own LossScaleOptimizer holds the stages' scale and step count (its file)
    assert run_["model_scale"] == run_["scales"][0][1], run_
    assert [run_["model_iterations"]] * 2 == run_["stage_iterations"], run_
    assert run_["model_iterations"] > 0, run_


def test_a_layer_with_state_the_step_would_change_is_refused_in_one_line(results):
    raised = _case(results, "state")["dropout"]["raised"]
    assert raised is not None and raised.startswith("layer='drop (Dropout)'"), raised
    assert "\n" not in raised, raised


def test_a_learning_rate_callback_reaches_the_stages(results):
    run_ = _case(results, "state")["rate_zero"]
    assert run_["epoch_1_moved"] > 0 and run_["epoch_2_moved"] == 0.0, run_
    assert run_["iterations"] == run_["steps"], run_
    assert run_["trainer_kept"], run_  # the stage optimizers' state outlives the change


def test_skipped_fp32_steps_keep_the_scale_at_one(results):
    run_ = _case(results, "state")["skipped"]
    assert run_["scales"] == [1.0, 1.0], run_
    assert run_["finite_step"] == 0.0, run_


def test_a_last_batch_that_does_not_split_is_refused_before_any_step(results):
    run_ = _case(results, "state")["remainder"]
    assert run_["raised"] is not None and run_["raised"].startswith("microbatches="), run_
    assert run_["moved"] == 0.0 and run_["iterations"] == 0, run_
    assert run_["stage_iterations"] == [0, 0], run_  # no stage took a step


def test_an_interrupted_fit_leaves_the_steps_taken_in_the_model(results):
    run_ = _case(results, "state")["interrupted"]
    assert run_["moved"] > 0 and run_["against_two_steps"] == 0.0, run_


def test_a_new_distribution_or_compile_builds_a_new_trainer(results):
    run_ = _case(results, "state")["rebuilt"]
    assert run_["microbatches"] == 2 and run_["accuracy"] is None, run_
    assert run_["iterations"] == [2, 4], run_  # seeded from the model's optimizer


def test_callbacks_see_and_keep_the_weights_they_should(results):
    state = _case(results, "state")
    # a callback's set_weights in on_train_end is not undone (EarlyStopping's best)
    assert state["set_at_end"]["moved"] == 0.0, state["set_at_end"]
    # a LambdaCallback's batch-end hook sees every step's weights
    assert all(m > 0 for m in state["lambda"]["moved"]), state["lambda"]
    assert len(state["lambda"]["moved"]) == 2, state["lambda"]


def test_a_generator_and_a_constant_weight_train(results):
    run_ = _case(results, "state")["generator"]
    assert run_["raised"] is None, run_
    assert run_["moved"] > 0 and run_["iterations"] == 3, run_


@pytest.mark.parametrize("name,setting", [("stage_axis_last", "DeviceMesh.axis_names"),
                                          ("chimera", "schedule"),
                                          ("backup_and_restore", "callbacks")])
def test_a_bad_combination_gets_one_line(results, name, setting):
    raised = _case(results, "refusals")[name]["raised"]
    assert raised is not None, name
    assert raised.startswith(setting + "=") and "\n" not in raised, raised


def test_model_save_then_load_model_continues_adam(results):
    # the file holds the stage optimizers' state (step count, Adam's m and v): one epoch,
    # save, load, one more equals two epochs on one device (Adam's 3D tolerance)
    run_ = _case(results, "resume")["save_load"]
    assert run_["loaded_iterations"] == 3 and run_["iterations"] == 6, run_
    assert run_["weights"] <= TOLERANCE["adam"], run_


def test_keras_backup_and_restore_resumes_the_run(results):
    run_ = _case(results, "resume")["backup"]
    assert run_["stopped"] and run_["epochs_run"] == 1, run_  # resumed at the second epoch
    assert run_["iterations"] == 6, run_
    assert run_["weights"] <= TOLERANCE["adam"], run_


@pytest.mark.parametrize("codec", ["topk", "powersgd", "adam_front"])
def test_keras_files_hold_the_codec_state(results, codec):
    # BackupAndRestore, save -> load_weights, load_model: each equals two uninterrupted
    # epochs (keras_codec_files.check_codec)
    keras_codec_files.check_codec(_case(results, "codec_files")[codec], codec, "down1/kernel")


def test_a_file_of_another_codec_is_refused(results):
    keras_codec_files.check_other_codec(_case(results, "codec_files")["other_codec"])


def test_a_file_of_a_codec_with_the_same_entries_is_refused(results):
    keras_codec_files.check_lookalikes(_case(results, "codec_files"))


def test_keras_files_hold_the_codec_state_of_weights_whose_paths_repeat(results):
    # two nested models' Dense "proj": `proj/kernel` and `proj/kernel#2`, each restored
    keras_codec_files.check_nested(_case(results, "codec_nested")["powersgd"], "powersgd")


def test_a_codec_file_without_tfpar_fails_in_one_line(results):
    keras_codec_files.check_without_tfpar(_case(results, "codec_files")["without_tfpar"])


def test_skipped_fp32_steps_are_counted_and_nan_guard_stops_on_them(results):
    run_ = _case(results, "guards")["nonfinite"]
    assert run_["counted"] == 2.0, run_
    raised = run_["raised"]
    # the skipped gradients, not the loss, stop it: at the step that had them
    assert raised is not None and raised.startswith(
        "gradients became non-finite at step 1"), raised
    assert "\n" not in raised, raised


def test_a_layer_assigning_its_own_state_is_refused_before_any_step(results):
    run_ = _case(results, "guards")["assigns"]
    raised = run_["raised"]
    assert raised is not None and raised.startswith("layer='running (RunningMean)'"), raised
    assert "\n" not in raised, raised
    assert run_["moved"] == 0.0 and run_["iterations"] == 0, run_


@pytest.mark.parametrize("case,line", [
    ("metric", "layer='tracked (Tracked)' is invalid: updates its own keras.metrics in call"),
    ("clip", "layer='clipped (Clipped)' is invalid: assigns its trainable weight in call"),
    ("outside_read", "variable='beta' is invalid: is held by no layer"),
    ("outside_write", "variable='calls' is invalid: is held by no layer"),
    ("outside_raw", "variable='a tf.Variable (AssignAddVariableOp "),
    ("outside_held", "variable='temperature' is invalid: is held by no layer"),
    ("kernel_regularizer", "layer='decayed (Dense)' is invalid: adds its own loss terms"),
    ("activity_regularizer", "layer='sparse (Dense)' is invalid: adds its own loss terms"),
    ("add_loss", "layer='a layer of ")])
def test_what_the_stateless_step_would_drop_is_refused_before_any_step(results, case, line):
    # Before, a layer's own metric (which fit reports on one device), a trainable weight
    # clipped in call and a variable no layer holds assigned in call (a Keras one, or a
    # tf.Variable) ran silently wrong (the copy's metric, the writes dropped or, the
    # tf.Variable's, not counted as on one device); a variable no layer holds read in call
    # failed in DTensor's mesh propagation, and one the model holds directly in a
    # TfparError with no way out. A layer's own loss terms (regularizers, add_loss) were
    # left out of the stages' loss silently (an L2(0.5) kernel regularizer: 0.076 from one
    # device's weights, the loss the plain model's).
    run_ = _case(results, "guards")[case]
    raised = run_["raised"]
    assert raised is not None and raised.startswith("ConfigError: " + line), raised
    assert "\n" not in raised, raised
    assert run_["moved"] == 0.0 and run_["iterations"] == 0, run_
    if case == "outside_raw":  # the op's name holds the layer's
        assert "raw_counting" in raised, raised
    if case == "add_loss":
        assert "(add_loss in call)' is invalid: adds its own loss terms" in raised, raised


def test_a_frozen_regularized_layer_is_not_refused(results):
    # Keras adds a regularizer's term for trainable weights only: a frozen block has none
    run_ = _case(results, "guards")["frozen_regularizer"]
    assert run_["raised"] is None and run_["iterations"] > 0 and run_["moved"] > 0, run_


def test_unnamed_weights_train_as_on_one_device(results):
    run_ = _case(results, "guards")["unnamed"]
    assert run_["raised"] is None, run_
    assert run_["weights"] <= TOLERANCE["adam"], run_


@pytest.mark.parametrize("optimizer", ["adam", "adafactor"])
def test_slots_pair_by_weight_not_by_colliding_names(results, optimizer):
    # Adam: two nested models' Dense "proj"; Adafactor: (12, 8) kernels "x/y_kernel" and
    # "x_y/kernel", its factors named by the bare "y_kernel"/"kernel"
    run_ = _case(results, "slots")[optimizer]
    assert run_["split"] <= 1e-6, run_  # fit(1) + fit(1) == fit(2)
    assert run_["one_device"] <= TOLERANCE["adam"], run_


def test_model_save_holds_every_slot_of_colliding_names(results):
    moments = _case(results, "slots")["adam"]["saved_moments"]
    # momentum and velocity of 2 x proj/{kernel,bias} and head/{kernel,bias}
    assert len(moments) == 12 and all(value > 0 for _, value in moments), moments


def test_a_layer_frozen_after_a_fit_keeps_its_slots(results):
    # the same optimizer recompiled after block1 is frozen: the variables that change in
    # the second fit are one device's (block1's moments untouched), the weights its too
    run_ = _case(results, "slots")["frozen"]
    # (the step count among them: the stage holding only block1 never steps)
    assert run_["changed"] == run_["one_device_changed"], run_
    assert run_["one_device"] <= TOLERANCE["adam"], run_


def test_a_layer_shared_across_stages_is_refused_in_one_line(results):
    raised = _case(results, "slots")["shared"]
    assert raised is not None and raised.startswith(
        "ConfigError: layer='shared (Dense)'"), raised
    assert "\n" not in raised, raised


def test_an_error_after_a_refusal_is_its_own(results):
    run_ = _case(results, "slots")["stale"]
    refused, later, good = run_["raised"]
    assert refused is not None and refused.startswith("ConfigError: layer='flag"), run_
    assert later is not None and "layer='flag" not in later, run_  # not the old refusal
    assert good is None and run_["iterations"] == 2, run_


def test_the_cli_pipeline_evaluates_in_inference_mode(results):
    run_ = _case(results, "guards")["eval_dropout"]
    reference = run_["reference"]
    # Dropout(0.5) off: the one-device evaluate's loss, every time
    assert abs(run_["fit_evaluate"] - reference) <= 1e-5, run_
    assert all(abs(loss - reference) <= 1e-5 for loss in run_["cli"]), run_


@pytest.fixture(scope="module")
def cli_and_fit(tmp_path_factory):
    """The CLI's 3D run (`tests/train_configs_child.py`: `tfpar.train.train`) and the
    same settings as a user's `fit` (the child's `cli` case), side by side."""
    folder = tmp_path_factory.mktemp("keras_3d_cli")
    out = str(folder / "fit")
    cli, fit = run_concurrently([
        lambda: train_configs(str(folder / "cli"), CLI_3D),
        lambda: last_json_line(run([sys.executable, CHILD, "cli", json.dumps(CLI_3D), out],
                                   timeout=600).stdout)])
    assert fit["grappler"] == "default", fit["grappler"]  # as the CLI's runs
    return [(weights(str(folder / f"cli.{i}")), weights(f"{out}.{i}"), cli[None][i],
             _case(fit, "cli")[i]) for i in range(len(CLI_3D))]


@pytest.mark.parametrize("i", range(len(CLI_3D)),
                         ids=["adam", "powersgd_fp16", "adam_in_front_of_powersgd"])
def test_the_cli_3d_run_and_a_users_fit_reach_the_same_weights(cli_and_fit, i):
    cli_weights, fit_weights, cli, fit = cli_and_fit[i]
    assert fit["unit_sample_weights"], fit  # the run's batches: no padding weights
    assert cli["steps"] == fit["iterations"] == CLI_3D[i]["steps"], (cli, fit)
    assert [w.shape for w in cli_weights] == [w.shape for w in fit_weights], fit["paths"]
    # the same trainer (MeshPipelineTrainer) on the same stages, layouts and batches:
    # 0.0 measured for each (2026-12-06)
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(cli_weights, fit_weights))
    assert gap <= 1e-6, gap
    if "compression" in CLI_3D[i]:  # the codec ran on both: the same bytes on the wire
        if CLI_3D[i].get("mixed_precision") == "fp16":
            assert fit["optimizer"] == "LossScaleOptimizer", fit
        sent = sum(stage["bytes_on_wire_per_step"] for stage in fit["bytes"])
        assert sent == cli["comm"]["bytes_on_wire_per_step"], (fit["bytes"], cli["comm"])
        assert sent < cli["comm"]["bytes_uncompressed_per_step"] / 2, cli["comm"]
