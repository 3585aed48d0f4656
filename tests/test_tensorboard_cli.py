"""`python -m tfpar.train --tensorboard_dir=D` writes tfpar's `tfpar/` scalars on every
backend: data parallel with a codec, fp16 loss scaling and the communication share; a
tf.distribute pipeline; tf_keras (`--keras=2`); a DTensor mesh with a codec; dp × tp × pp.
The event files are read back and held against the run's metrics JSON and against what
the settings imply (fp16 sends half of fp32's bytes, int8 a quarter plus a scale per
tensor, a 2-stage 4-micro-batch 1F1B bubble is 1/5)."""

import json
import os
import sys

import numpy as np
import pytest

import subproc

MLP_TENSORS = 6  # the default mlp: 3 Dense layers, a kernel and a bias each

CASES = {
    "data_parallel": ("--cpu_devices=2", "--compression=fp16", "--mixed_precision=fp16",
                      "--measure_comm", "--steps=6", "--steps_per_epoch=3"),
    "pipeline": ("--cpu_devices=2", "--pipeline_stages=2", "--microbatches=4", "--steps=4"),
    "tf_keras": ("--keras=2", "--cpu_devices=2", "--compression=fp16",
                 "--mixed_precision=fp16", "--steps=4"),
    "mesh": ("--cpu_devices=4", "--tensor_parallel=2", "--data_parallel=2",
             "--compression=int8", "--steps=4"),
    "mesh_3d": ("--cpu_devices=8", "--tensor_parallel=2", "--data_parallel=2",
                "--pipeline_stages=2", "--microbatches=4", "--compression=int8", "--steps=4"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case through one child (`subproc.run_cli_cases`): {case: (its metrics dict,
    {tag: [(step, value), ...]} of its `train` event files)}."""
    folder = tmp_path_factory.mktemp("tb")
    cases = [((*argv, f"--tensorboard_dir={folder / name}",
               f"--metrics_json={folder / name}.json", "--verbose=0"), None)
             for name, argv in CASES.items()]
    outs = subproc.run_cli_cases(cases, timeout=500)
    result = {}
    for name, out in zip(CASES, outs):
        assert out.returncode == 0, (name, out.stderr[-3000:])
        metrics = json.loads((folder / f"{name}.json").read_text())
        result[name] = (metrics, scalars(folder / name / "train"))
    return result


def scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    events = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    events.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                  for e in events.Tensors(tag)]
            for tag in events.Tags()["tensors"] if tag != "keras"}  # "keras": the model


def values(tags, name):
    return [v for _, v in tags[f"tfpar/{name}"]]


def check_steps_and_loss(metrics, tags, steps_per_epoch=None):
    """One `step_time_ms` and `skipped_steps` per step at the optimizer's steps 1..N;
    Keras's `epoch_loss` is the mean of the metrics JSON's per-step losses of the epoch."""
    steps = metrics["steps"]
    for name in ("step_time_ms", "skipped_steps"):
        assert [s for s, _ in tags[f"tfpar/{name}"]] == list(range(1, steps + 1)), name
    assert all(v > 0 for v in values(tags, "step_time_ms"))
    assert values(tags, "skipped_steps")[-1] == metrics.get("skipped_steps", 0)
    per_epoch = steps_per_epoch or steps
    losses = np.reshape(metrics["loss_history"], (-1, per_epoch)).mean(axis=1)
    np.testing.assert_allclose([v for _, v in tags["epoch_loss"]], losses, rtol=1e-5)


def test_data_parallel_writes_bytes_loss_scale_and_comm_share(runs):
    metrics, tags = runs["data_parallel"]
    check_steps_and_loss(metrics, tags, steps_per_epoch=3)
    comm = metrics["comm"]
    # fp16 hands the collective 2 bytes per gradient entry, fp32 4.
    assert values(tags, "bytes_on_wire") == [comm["bytes_on_wire_per_step"]] * 6
    assert comm["bytes_on_wire_per_step"] * 2 == comm["bytes_uncompressed_per_step"]
    assert values(tags, "compression_ratio") == [2.0] * 6
    assert values(tags, "loss_scale") == [2.0 ** 15] * 6  # Keras's initial scale, kept
    # The share the trainer measured after training (once: the same number in both).
    (step, share), = tags["tfpar/comm_time_fraction"]
    assert step == 6 and share == pytest.approx(comm["comm_time_fraction"], rel=1e-6)
    assert values(tags, "comm_step_ms")[0] > 0


def test_pipeline_writes_its_bubble(runs):
    metrics, tags = runs["pipeline"]
    check_steps_and_loss(metrics, tags)
    bubble = metrics["pipeline"]
    assert values(tags, "pipeline_bubble") == [pytest.approx(1 / 5)] * 4  # (K-1)/(M+K-1)
    assert bubble["bubble_theory"] == pytest.approx(1 / 5)
    assert values(tags, "pipeline_bubble_measured") == [
        pytest.approx(bubble["bubble_measured"], rel=1e-6)]
    assert "tfpar/bytes_on_wire" not in tags  # one replica: nothing is communicated


def test_tf_keras_writes_the_same_scalars(runs):
    metrics, tags = runs["tf_keras"]
    data_parallel = runs["data_parallel"][0]["comm"]
    check_steps_and_loss(metrics, tags)
    # The same mlp and codec as the Keras 3 run: the same bytes.
    assert values(tags, "bytes_on_wire") == [metrics["comm"]["bytes_on_wire_per_step"]] * 4
    assert metrics["comm"]["bytes_on_wire_per_step"] == data_parallel["bytes_on_wire_per_step"]
    assert values(tags, "loss_scale") == [2.0 ** 15] * 4


@pytest.mark.parametrize("case", ["mesh", "mesh_3d"])
def test_mesh_writes_its_codec_bytes(runs, case):
    metrics, tags = runs[case]
    check_steps_and_loss(metrics, tags)
    # int8 on the mesh's batch axis: a byte per gradient entry and a 4-byte scale per
    # tensor; the entries counted by the tf.distribute aggregator of the same mlp.
    entries = runs["data_parallel"][0]["comm"]["bytes_uncompressed_per_step"] // 4
    wire = metrics["comm"]["bytes_on_wire_per_step"]
    assert wire == entries + 4 * MLP_TENSORS
    assert values(tags, "bytes_on_wire") == [wire] * 4
    if case == "mesh_3d":
        assert values(tags, "pipeline_bubble") == [pytest.approx(1 / 5)] * 4
        assert metrics["pipeline"]["bubble_theory"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("mesh", ["2d", "3d"])
def test_a_users_fit_on_a_keras_mesh_writes_its_codec_bytes(tmp_path, mesh):
    # `tfpar.callbacks.TensorBoard` in a user's own `fit` under `keras.distribution`
    # (ModelParallel; tfpar's PipelineParallel) with a `DistributedOptimizer` codec: the
    # codec runs in the mesh's `batch` reduction, whose bytes are written (the callback
    # raised "needs build() first" on the unbuilt aggregator before). int8: a byte per
    # gradient entry and a 4-byte scale per tensor.
    child = os.path.join(subproc.ROOT, "tests", "keras_mesh_tensorboard_child.py")
    out = subproc.last_json_line(subproc.run(
        [sys.executable, child, str(tmp_path), mesh], timeout=400).stdout)
    wire = out["entries"] + 4 * out["tensors"]
    assert out["comm"]["bytes_on_wire_per_step"] == wire, out
    assert out["comm"]["bytes_uncompressed_per_step"] == 4 * out["entries"], out
    tags = scalars(tmp_path / "train")
    assert values(tags, "bytes_on_wire") == [wire] * out["steps"]
