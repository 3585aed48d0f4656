"""The public API at the top of `tfpar`: its docstring examples run, bad arguments give one
line, the caller's optimizer is left alone, and TensorBoard gets tfpar's scalars."""

import os
import sys

import numpy as np
import pytest

from tests import subproc

PUBLIC = ["tfpar.make_strategy", "tfpar.enable", "tfpar.DistributedOptimizer",
          "tfpar.PipelineModel",
          "tfpar.wait_for_workers", "tfpar.callbacks.BackupAndRestore",
          "tfpar.callbacks.TensorBoard"]


@pytest.fixture(scope="module")
def docstring_runs(tmp_path_factory):
    """Each public name's docstring examples in a process of its own (they build
    strategies), and tests/tensorboard_child.py's run, all forked from one child
    (tests/doc_child.py), which first checks what `import tfpar` loads: {"names": {name: its
    result}, "import_check": two lines, "tensorboard": its result, "log_root": where it
    wrote}."""
    log_root = tmp_path_factory.mktemp("tensorboard")
    out = subproc.run([sys.executable, os.path.join(subproc.ROOT, "tests", "doc_child.py"),
                       str(tmp_path_factory.mktemp("doc")), f"--tensorboard={log_root}",
                       *PUBLIC], timeout=600, fresh=True)  # it checks what import tfpar loads
    return {**subproc.last_json_line(out.stdout), "log_root": log_root}


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_examples_run(docstring_runs, name):
    out = docstring_runs["names"][name]
    assert out["returncode"] == 0 and " 0 failed" in out["stdout"], out


def test_import_tfpar_loads_no_tensorflow(docstring_runs):
    # Checked first thing in the docstring child (tests/doc_child.py `import_check`).
    lines = docstring_runs["import_check"]
    assert lines == ["[]", "tfpar.api True"], lines


@pytest.mark.parametrize("call, setting", [
    (lambda t: t.make_strategy(colective="ring"), "colective"),
    (lambda t: t.make_strategy(kind="mirorred"), "kind"),
    (lambda t: t.make_strategy(cpu_devices=0), "cpu_devices"),
    (lambda t: t.make_strategy(collective_timeout_s=-1), "collective_timeout_s"),
    (lambda t: t.DistributedOptimizer("adam", compression="zip"), "compression"),
    (lambda t: t.DistributedOptimizer("adam", compression="topk", rank=2), "rank"),
    (lambda t: t.DistributedOptimizer("adam", compression="topk", ratio=2.0), "compression"),
    (lambda t: t.DistributedOptimizer("adam", compression="topk", on_nan="ignore"), "on_nan"),
])
def test_bad_arguments_give_one_line(call, setting):
    import tfpar
    with pytest.raises(tfpar.ConfigError) as err:
        call(tfpar)
    assert err.value.setting == setting
    assert "\n" not in str(err.value) and "invalid" in str(err.value)


def test_distributed_optimizer_is_a_new_object_and_leaves_the_callers_alone():
    import keras

    import tfpar
    from tfpar.compression import PowerSGDAggregator, aggregator_of
    mine = keras.optimizers.Adam(learning_rate=0.01, beta_1=0.8)
    wrapped = tfpar.DistributedOptimizer(mine, compression="powersgd", rank=2)
    assert wrapped is not mine and type(mine) is keras.optimizers.Adam
    assert aggregator_of(mine) is None
    assert isinstance(aggregator_of(wrapped), PowerSGDAggregator)
    assert aggregator_of(wrapped).rank == 2 and aggregator_of(wrapped).timeout_s == 120.0
    assert wrapped.get_config()["beta_1"] == pytest.approx(0.8)
    assert float(wrapped.learning_rate) == pytest.approx(0.01)


def test_mixed_precision_policy_is_reset_only_when_a_run_set_it():
    """A process training several configs gets float32 back after a bf16 run; a policy
    the user set themselves is not touched by a run without --mixed_precision."""
    import keras

    from tfpar import optimizers
    mp = keras.mixed_precision
    try:
        optimizers.set_policy("bf16")
        assert mp.global_policy().name == "mixed_bfloat16"
        optimizers.set_policy("none")
        assert mp.global_policy().name == "float32"
        mp.set_global_policy("mixed_float16")  # the user's own
        optimizers.set_policy("none")
        assert mp.global_policy().name == "mixed_float16"
    finally:
        mp.set_global_policy("float32")


def test_tensorboard_event_files_hold_tfpar_scalars(docstring_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    board = docstring_runs["tensorboard"]
    assert board["returncode"] == 0, board["stderr"][-3000:]
    facts = subproc.last_json_line(board["stdout"])
    tmp_path = docstring_runs["log_root"]

    def scalars(run):
        events = EventAccumulator(str(tmp_path / run / "train"), size_guidance={"tensors": 0})
        events.Reload()
        return {tag: [float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)]
                for tag in events.Tags()["tensors"] if tag.startswith("tfpar/")}

    dp = scalars("data_parallel")
    for tag in ("step_time_ms", "bytes_on_wire", "compression_ratio", "skipped_steps",
                "loss_scale", "comm_time_fraction"):
        assert "tfpar/" + tag in dp, sorted(dp)
    assert len(dp["tfpar/step_time_ms"]) == facts["steps"]
    # int8 sends a quarter of fp32's bytes (plus a scale per bucket).
    assert dp["tfpar/bytes_on_wire"][-1] == facts["bytes_on_wire"]
    assert 3.5 < dp["tfpar/compression_ratio"][-1] <= 4.0
    # The huge initial loss scale overflows fp16: steps are skipped and the scale halves.
    assert dp["tfpar/skipped_steps"][-1] == facts["skipped_steps"] >= 1
    assert dp["tfpar/loss_scale"][-1] == facts["loss_scale"] < dp["tfpar/loss_scale"][0]
    assert 0.0 <= dp["tfpar/comm_time_fraction"][0] <= 1.0
    pipe = scalars("pipeline")
    assert pipe["tfpar/pipeline_bubble"][-1] == pytest.approx(1 / 5)  # 1F1B, K=2, M=4


def test_distributed_optimizer_without_a_strategy_trains_as_the_plain_optimizer():
    import keras

    import tfpar
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = x @ rng.normal(size=(8, 2)).astype("float32")
    weights = []
    for wrap in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(2)])
        optimizer = keras.optimizers.Adam(1e-2)
        if wrap:  # one replica: nothing to communicate, so nothing is compressed
            optimizer = tfpar.DistributedOptimizer(optimizer, compression="powersgd", rank=1)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for plain, wrapped in zip(*weights, strict=True):
        np.testing.assert_array_equal(plain, wrapped)


def test_distributed_optimizer_serialises_as_the_plain_optimizer():
    # saved as the optimizer it copies, so stock Keras loads it (tests/test_layout_keras_state
    # loads a saved model in a process without tfpar); files of earlier versions still load
    import keras

    import tfpar
    from tfpar.compression import aggregator_of
    wrapped = tfpar.DistributedOptimizer(keras.optimizers.Adam(0.01, name="a"),
                                         compression="topk", ratio=0.05)
    config = keras.optimizers.serialize(wrapped)
    plain = keras.optimizers.serialize(keras.optimizers.Adam(0.01, name="a"))
    assert config["class_name"] == "Adam" and config["config"] == plain["config"]
    back = keras.optimizers.deserialize(config)
    assert type(back) is keras.optimizers.Adam and aggregator_of(back) is None
    assert float(back.learning_rate) == pytest.approx(0.01)
    earlier = {"module": "tfpar.api", "class_name": "DistributedAdam",
               "registered_name": "tfpar>DistributedAdam",
               "config": {**plain["config"], "compression": {
                   "class_name": "TopKAggregator", "config": aggregator_of(wrapped).get_config()}}}
    loaded = keras.optimizers.deserialize(earlier)
    assert aggregator_of(loaded).ratio == 0.05
    assert float(loaded.learning_rate) == pytest.approx(0.01)
    assert keras.optimizers.serialize(loaded)["class_name"] == "Adam"
    scaled = tfpar.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=64.0), compression="fp16")
    assert isinstance(scaled, keras.optimizers.LossScaleOptimizer)
    assert aggregator_of(scaled).dtype_name == "fp16" and scaled.initial_scale == 64.0


def test_topk_and_threshold_have_one_default_for_the_api_and_the_trainer():
    # Issue 43: DistributedOptimizer(compression="topk") sent 1 % without the union where
    # --compression=topk sent 25 % with it; both now read tfpar.config's defaults.
    import keras

    import tfpar
    from tfpar.compression import aggregator_of, make_aggregator
    keys = ("ratio", "dense_below", "union", "adam_momentum_carry", "warmup_steps",
            "adam", "adam_warmup_steps", "adam_variance")
    api = aggregator_of(tfpar.DistributedOptimizer(keras.optimizers.Adam(),
                                                   compression="topk")).get_config()
    trainer = make_aggregator(tfpar.ParallelConfig(compression="topk",
                                                   optimizer="adam")).get_config()
    assert {k: api[k] for k in keys} == {k: trainer[k] for k in keys}
    assert (api["ratio"], api["union"], api["adam_variance"]) == (0.25, True, "local_debiased")
    threshold = aggregator_of(tfpar.DistributedOptimizer("sgd", compression="threshold"))
    assert threshold.threshold == tfpar.ParallelConfig().threshold
