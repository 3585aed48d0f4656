"""A compressing `tfpar.DistributedOptimizer` in a user's own `model.fit` under Keras's
`ModelParallel` (2×2: `batch` × `model`, 4 logical CPUs): the step forms each replica's
gradient and averages it through the mesh trainer's batch-axis reduction
(`tfpar.layout.reduction`), against the uncompressed run (plain Adam, DTensor's own sum)
on the same seed and batches. Over Adam, top-k, PowerSGD and lowbit take Adam in front of
them (`tfpar.layout.adam_front`), as the CLI's mesh trainer does: its exact warm-up against
the uncompressed fit, its compressed steps against the trainer's mesh step. One child,
ten cases (tests/keras_mesh_codecs_child.py).

Bands, measured 2026-12-05 (one run each, deterministic on this seed; mean of the last 5
step losses over 40 Adam steps, lr 1e-2): int8 -0.1 %, PowerSGD rank 1 (Adam in front, 5
exact steps) +1.9 %, the same under `mixed_float16` +1.8 % against uncompressed fp16 (with
Adam behind PowerSGD, before it went in front: +2.6 %, +2.7 %). The band below is 4 %, as
lowbit's on the mesh trainer (tests/test_layout_mesh.py).
The child runs with grappler off (tests/graph_optimizer.py), every fit and the CLI's
mesh trainer it is compared with alike. A second child, with TensorFlow's default
optimizer (grappler on, as users run; tests/keras_3d_child.py's `powersgd` and `cli` cases
fit codecs with it on the pipeline mesh, nothing else under plain `ModelParallel`), fits
SGD with top-k at ratio 1 against plain SGD, 4 steps: equal.
"""

import os
import sys

import numpy as np
import pytest

import cases as cases_lib
import keras_codec_files
from graph_optimizer import OFF as GRAPPLER_OFF
from subproc import ROOT, last_json_line, run

CHILD = os.path.join(ROOT, "tests", "keras_mesh_codecs_child.py")
BAND = 0.04


@pytest.fixture(scope="module")
def results():
    names = ("codecs,fp16,save,nan,data_parallel,adam_front,refusals,keras_files,keras_nested,"
             "keras_fp16")
    out = last_json_line(run([sys.executable, CHILD, names], timeout=900,
                             env=GRAPPLER_OFF).stdout)
    assert out["grappler"] == "off", out["grappler"]  # as asked, every fit alike
    return out


@pytest.fixture(scope="module")
def default_optimizer():
    """The grappler-on child's case (a fixture of its own: its time is its test's, not
    added to the long child's)."""
    out = last_json_line(run([sys.executable, CHILD, "sgd_codec"], timeout=600).stdout)
    assert out["grappler"] == "default", out["grappler"]
    return out


def _case(results, name):
    return cases_lib.case(results, name, "keras_mesh_codecs_child.py")


def test_codecs_at_their_limit_equal_the_uncompressed_run(results):
    runs = _case(results, "codecs")
    for name in ("none", "powersgd_full_rank", "topk_ratio_1"):
        assert runs[name]["diff"] <= 1e-5, (name, runs[name]["diff"])
        assert runs[name]["state"]["bytes"] is not None, name  # the reduction ran
        assert np.allclose(runs[name]["losses"], runs["plain"]["losses"], atol=1e-5), name
    # Adam in front of PowerSGD and top-k by default: 4 steps of its exact warm-up, equal to
    # the uncompressed mesh fit (each replica's gradient, their fp32 mean, Keras's Adam)
    assert runs["none"]["state"]["reduction"] == "BatchAxisReduction"
    for name in ("powersgd_full_rank", "topk_ratio_1"):
        assert runs[name]["state"]["reduction"] == "AdamFrontReduction", name
        assert runs[name]["none_diff"] <= 1e-6, (name, runs[name]["none_diff"])
    # the state the checkpoint names, laid out like the gradients
    assert "up/kernel/residual" in runs["topk_ratio_1"]["state"]["names"]
    # the saved file holds the plain optimizer (tfpar's mixins are not on the mesh's copy)
    assert runs["powersgd_full_rank"]["optimizer"] == "Adam"


def test_a_codec_fit_with_tensorflows_default_optimizer_equals_plain_sgd(default_optimizer):
    # Grappler on: its fusions and its dependency optimizer (which edits the control edges
    # around the collectives) meet the batch-axis reduction in a user's model.fit.
    out = _case(default_optimizer, "sgd_codec")
    assert out["state"]["reduction"] == "BatchAxisReduction", out["state"]
    assert out["state"]["bytes"]["bytes_on_wire_per_step"] > 0, out["state"]
    assert out["diff"] <= 1e-5, out["diff"]


@pytest.mark.parametrize("name", ["int8", "powersgd_rank_1"])
def test_lossy_codecs_run_and_end_near_the_uncompressed_run(results, name):
    runs = _case(results, "codecs")
    run_, plain = runs[name], runs["plain"]
    stats = run_["state"]["bytes"]
    assert stats["bytes_on_wire_per_step"] < stats["bytes_uncompressed_per_step"] / 3, stats
    assert run_["state"]["max_abs"] > 0, run_["state"]  # residuals (and Q) were written
    assert run_["diff"] > 0  # it changed the training, so it ran
    gap = run_["far_loss"] / plain["far_loss"] - 1
    assert abs(gap) <= BAND, (name, gap)


def test_powersgd_trains_under_mixed_float16_with_the_loss_scale(results):
    out = _case(results, "fp16")
    plain, compressed = out["plain"], out["powersgd"]
    assert compressed["optimizer"] == "LossScaleOptimizer"
    assert compressed["finite"] and compressed["state"]["max_abs"] > 0
    assert compressed["state"]["bytes"]["compression_ratio"] > 5
    assert compressed["losses"][-1] < compressed["losses"][0]
    gap = np.mean(compressed["losses"][-5:]) / np.mean(plain["losses"][-5:]) - 1
    assert abs(gap) <= BAND, gap


def test_the_codec_state_survives_tfpar_backup_and_restore(results):
    out = _case(results, "save")
    # tfpar's BackupAndRestore holds `codec/<weight>/residual` and `.../powersgd_q`
    assert "up/kernel/powersgd_q" in out["restored_names"]
    assert out["restored_names"] == out["state_names"]
    assert out["resumed_steps"] == 0 and out["iterations"] == 4  # restored, not retrained
    assert out["first_max_abs"] > 0 and out["restored_diff"] == 0.0
    # Keras's own file names the codec (its state: test_keras_files_hold_the_codec_state):
    # load_model gives a DistributedOptimizer over Adam, its reduction made at its fit
    assert out["loaded_optimizer"] == "Adam" and out["loaded_codec"] == "PowerSGDAggregator"
    assert out["loaded_reductions"] == 0


def test_what_the_mesh_does_not_compress_is_refused_in_one_line(results):
    out = _case(results, "refusals")
    assert out["train_step"]["raised"] == "ConfigError" and out["train_step"]["lines"] == 1
    assert out["train_step"]["line"].startswith("compression='powersgd'")
    assert "own train_step" in out["train_step"]["line"]
    assert out["auto"]["raised"] == "ConfigError" and out["auto"]["lines"] == 1
    assert out["auto"]["line"].startswith("compression='auto'")
    # Adam in front of the mesh's codec: tf.distribute's live `v` and its refresh steps
    for name, line in (("live", "adam_variance='live'"), ("refresh", "adam_refresh_every=10")):
        assert out[name]["raised"] == "ConfigError" and out[name]["lines"] == 1, out[name]
        assert out[name]["line"].startswith(line), out[name]
        assert "keras.distribution" in out[name]["line"], out[name]


def test_adam_in_front_of_the_codec_equals_the_cli_mesh_trainer(results):
    # `DistributedOptimizer(Adam, codec)` in model.fit: Adam in front, as the CLI's mesh
    # trainer runs it; 2 exact steps, 3 compressed, the same weights and batches (a model
    # of one input, which the CLI's trainer takes); lowbit saved by tfpar's
    # BackupAndRestore after every step.
    out = _case(results, "adam_front")
    for codec, variance in (("lowbit", "local_debiased"), ("topk", "frozen")):
        run_ = out[codec]
        assert run_["reductions"] == ["AdamFrontReduction"] * 2, run_
        assert run_["variance"] == run_["cli_variance"] == variance, run_
        assert run_["counter"] == 5 and run_["residual_max_abs"] > 0, run_  # compressed
        assert run_["moved"] > 1e-3, run_
        assert run_["diff"] < 1e-5 and run_["state_diff"] < 1e-5, run_
        assert np.isfinite(run_["cli_losses"]).all(), run_
        assert run_["after_one_more"] == [True, 6], run_  # the state trains on
    # the codec's bytes after the warm-up (lowbit ~10x fewer; top-k sends 5 % of the two
    # kernels above its dense size, the rest whole)
    assert out["lowbit"]["bytes"]["compression_ratio"] > 5, out["lowbit"]["bytes"]
    assert out["topk"]["bytes"]["compression_ratio"] > 1.2, out["topk"]["bytes"]


def test_a_non_finite_step_is_skipped_with_the_codec_state_or_stops_in_one_line(results):
    out = _case(results, "nan")
    # on_nan="skip_step": weights, slots and the codec's residuals stay, the step is counted
    assert out["state_max_abs"] > 0  # there was state to spoil
    assert out["weights_moved"] == 0.0 and out["state_moved"] == 0.0, out
    assert out["skipped"] == 1.0
    assert out["moved_after"] > 0  # and it trains on
    # on_nan="stop" (the default) with tfpar's NaNGuard: one line naming the step
    assert out["stop"] is not None and len(out["stop"].splitlines()) == 1, out["stop"]
    assert "step 2" in out["stop"], out["stop"]


def test_data_parallel_runs_the_same_reduction(results):
    out = _case(results, "data_parallel")
    assert out["replicas"] == 4
    assert out["diff"] <= 1e-5, out["diff"]  # top-k at ratio 1: plain SGD's weights
    assert out["state"]["max_abs"] > 0
    assert out["state"]["bytes"]["compression_ratio"] > 5, out["state"]["bytes"]


def test_what_codec_of_cannot_map_is_refused_in_one_line():
    # The rulebook rows `codec_of` applies to a DistributedOptimizer's aggregator under
    # keras.distribution (no mesh needed: the mapping refuses before building anything).
    from tfpar import compression
    from tfpar.errors import ConfigError
    from tfpar.layout import reduction

    class Mine(compression.Int8Aggregator):
        pass

    for aggregator, line in ((compression.TopKAggregator(momentum=0.9), "momentum=0.9"),
                             (compression.AutoAggregator(), "compression='auto'"),
                             (Mine(), "compression='Mine'")):
        with pytest.raises(ConfigError) as err:
            reduction.codec_of(aggregator)
        assert str(err.value).startswith(line) and len(str(err.value).splitlines()) == 1
    assert reduction.codec_of(compression.TopKAggregator(ratio=0.5))[0] == "topk"


def test_a_codecs_identity_is_what_gives_its_state_its_meaning():
    # No mesh needed: the identity Keras's files record is the aggregator's codec and
    # options as the mesh maps them (`reduction.codec_of`), without PowerSGD's seed.
    from tfpar import compression, keras_codec_state
    from tfpar.errors import TfparError

    def identity(aggregator):
        return keras_codec_state.CodecState(aggregator=aggregator).identity()

    topk = identity(compression.TopKAggregator(ratio=0.1))
    assert topk["codec"] == "topk" and topk["topk_ratio"] == 0.1, topk
    assert keras_codec_state.decode_identity(keras_codec_state.encode_identity(topk)) == topk
    assert identity(compression.PowerSGDAggregator(rank=2, seed=0)) == identity(
        compression.PowerSGDAggregator(rank=2, seed=1))  # the seed draws the first Q only
    assert identity(compression.PowerSGDAggregator(rank=2)) != identity(
        compression.PowerSGDAggregator(rank=4))
    keras_codec_state.check_identity(topk, dict(topk))
    keras_codec_state.check_identity(topk, None)  # a holder without a codec takes any
    with pytest.raises(TfparError) as err:
        keras_codec_state.check_identity(topk, {**topk, "topk_ratio": 0.2})
    assert len(str(err.value).splitlines()) == 1 and "differ in ratio" in str(err.value)
    # an option one side does not record (a later tfpar's) is not a difference
    keras_codec_state.check_identity(topk, {**topk, "a_later_option": 1})
    # Adam in front's warm-up is: its moments change units at its end
    front = compression.PowerSGDAggregator(rank=1)
    front.adam, front.adam_warmup_steps = object(), 2
    warm2 = keras_codec_state.CodecState(aggregator=front).identity()
    front.adam_warmup_steps = 50
    assert "adam_warmup_steps" in warm2 and warm2 != keras_codec_state.CodecState(
        aggregator=front).identity(), warm2


def test_a_codec_the_mesh_does_not_run_still_saves_off_the_mesh(tmp_path):
    # One device, no mesh: Keras's save asks the holder for its entries (none) and its
    # identity used to be asked too, which raised for a codec the mesh refuses (`auto`,
    # PowerSGD's start_step, Adam in front without a warm-up) and left a broken file over
    # the user's earlier one.
    import keras

    import tfpar

    for options in ({"compression": "auto"},
                    {"compression": "powersgd", "rank": 1, "start_step": 5}):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                           **options), loss="mse")
        x = np.ones((8, 4), "float32")
        model.fit(x, x[:, :2], epochs=1, verbose=0)
        path = str(tmp_path / "m.keras")
        model.save(path)
        model.save_weights(str(tmp_path / "m.weights.h5"))
        loaded = keras.saving.load_model(path, compile=False)
        np.testing.assert_array_equal(loaded.get_weights()[0], model.get_weights()[0])


@pytest.mark.parametrize("codec", ["topk", "powersgd", "adam_front"])
def test_keras_files_hold_the_codec_state(results, codec):
    # BackupAndRestore, save -> load_weights, load_model: each equals two uninterrupted
    # epochs (keras_codec_files.check_codec)
    keras_codec_files.check_codec(_case(results, "keras_files")[codec], codec, "up/kernel")


def test_a_file_of_another_codec_is_refused(results):
    keras_codec_files.check_other_codec(_case(results, "keras_files")["other_codec"])


def test_a_file_of_a_codec_with_the_same_entries_is_refused(results):
    # top-k at 0.1's residuals read into top-k at 0.2 and into threshold: the same names
    # and shapes, told apart by the codec the file names
    keras_codec_files.check_lookalikes(_case(results, "keras_files"))


def test_keras_files_hold_the_codec_state_of_weights_whose_paths_repeat(results):
    # two nested models' Dense "proj": `proj/kernel` and `proj/kernel#2`, each restored
    keras_codec_files.check_nested(_case(results, "keras_nested")["topk"], "topk")


def test_load_model_of_an_fp16_codec_file_keeps_the_loss_scale(results):
    # mixed_float16: Keras's LossScaleOptimizer around the codec's optimizer; its scale
    # through model.save -> load_model, then one more epoch as two uninterrupted
    keras_codec_files.check_fp16(_case(results, "keras_fp16"))


def test_a_codec_file_without_tfpar_fails_in_one_line(results):
    keras_codec_files.check_without_tfpar(_case(results, "keras_files")["without_tfpar"])
