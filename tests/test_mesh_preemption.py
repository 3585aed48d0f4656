"""SIGTERM on the DTensor mesh backend: the run saves the step it is at, stops, and the same
command resumes to the uninterrupted run's losses and state, bit for bit.

dp2×tp2 with Adam (the checkpoint must carry the slots): on 4 logical CPUs of one process,
the signal sent by the process to itself after step 5 (tests/mesh_preemption_child.py),
and the same after step 3 for ZeRO-3 (dp4) and 3D (dp2×tp2×pp2, the mesh pipeline);
and over 2 processes × 2 logical CPUs (DTensor's multi-client mesh) of `python -m
tfpar.train`, where worker 1 alone gets SIGTERM as soon as both workers report their mesh
built (`TFPAR_READY`): it holds the signal (`tfpar.preemption.hold_sigterm`) and both stop
at the first agreed step, 5 (the guard agrees every 5 steps), whatever the timing, each
with exit status 143.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from subproc import ROOT, in_background, last_json_line, popen, run

MESH = {"model": "mlp", "optimizer": "adam", "tensor_parallel": 2, "data_parallel": 2,
        "global_batch_size": 16, "verbose": 0, "checkpoint_every": 1000}
CHILD = os.path.join(ROOT, "tests", "mesh_preemption_child.py")


def _tensors(prefix):
    """A checkpoint's tensors but the count of saves (the stopped job saved once more)."""
    reader = tf.train.load_checkpoint(prefix)
    return {k: np.asarray(reader.get_tensor(k)) for k in reader.get_variable_to_shape_map()
            if k != "_CHECKPOINTABLE_OBJECT_GRAPH" and not k.startswith("save_counter")}


def _stops_and_resumes_exactly(settings, tmp_path, after):
    """Runs the child: a SIGTERM after step `after` saves that step only, and the resumed
    run's losses and final state (Adam's slots among them) equal the uninterrupted run's."""
    out = run([sys.executable, CHILD, json.dumps(settings), str(tmp_path), str(after)],
              timeout=300)
    result = last_json_line(out.stdout)
    stopped, resumed, whole = result["stopped"], result["resumed"], result["whole"]
    assert f"tfpar: stopping at step {after} on SIGTERM: checkpoint saved" in out.stdout
    assert stopped["preempted"] is True and stopped["steps"] == after, stopped
    assert stopped["saved"] == [f"ckpt-{after}.index"], stopped
    assert resumed["resumed_from_step"] == after and not resumed["preempted"], resumed
    assert stopped["loss_history"] + resumed["loss_history"] == whole["loss_history"]
    final = np.load(tmp_path / "resumed.npz")
    expected = np.load(tmp_path / "whole.npz")
    assert sorted(final.files) == sorted(expected.files)
    assert any("optimizer" in name for name in final.files), final.files  # Adam's slots
    for name in expected.files:
        np.testing.assert_array_equal(final[name], expected[name], name)


def test_sigterm_on_a_mesh_in_one_process_saves_and_the_run_resumes_exactly(tmp_path):
    _stops_and_resumes_exactly({**MESH, "cpu_devices": 4, "steps": 12, "steps_per_epoch": 4},
                               tmp_path, 5)


@pytest.mark.parametrize("layout", [
    {"tensor_parallel": 1, "data_parallel": 4, "zero_stage": 3, "cpu_devices": 4},
    {"tensor_parallel": 2, "data_parallel": 2, "pipeline_stages": 2, "cpu_devices": 8},
], ids=["zero3-dp4", "3d-dp2-tp2-pp2"])
def test_sigterm_on_zero3_and_3d_saves_and_the_run_resumes_exactly(layout, tmp_path):
    """ZeRO-3's sharded weights and slots, and the mesh pipeline's stage meshes, through
    the same stop and resume (each its own layout of the state)."""
    _stops_and_resumes_exactly({**MESH, **layout, "steps": 6, "steps_per_epoch": 3},
                               tmp_path, 3)


def _workers(ckpt, metrics):
    """Worker 0 and 1 of `python -m tfpar.train` (dp2×tp2 over 2 processes × 2 logical
    CPUs), started as a user starts them by hand: each with its `TF_CONFIG`, output merged."""
    from tfpar.launch import free_ports
    hosts = [f"localhost:{p}" for p in free_ports(2, "localhost")]
    flags = {**MESH, "cpu_devices": 2, "steps": 15, "steps_per_epoch": 15,
             "checkpoint_dir": str(ckpt), "metrics_json": str(metrics)}
    command = [sys.executable, "-m", "tfpar.train", *(f"--{k}={v}" for k, v in flags.items())]
    return [popen(command, env={"PYTHONUNBUFFERED": "1", "TF_CONFIG": json.dumps(
        {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})},
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]


def _finish(procs, sigterm_worker=None, timeout=240):
    """Each worker's (exit status, output); with `sigterm_worker`, that worker alone gets
    SIGTERM as soon as both report their mesh built (`TFPAR_READY`)."""
    outputs = [[], []]
    try:
        if sigterm_worker is not None:
            for proc, lines in zip(procs, outputs):
                for line in proc.stdout:
                    lines.append(line)
                    if "TFPAR_READY" in line:
                        break
            procs[sigterm_worker].send_signal(signal.SIGTERM)
        for proc, lines in zip(procs, outputs):
            lines.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return [(proc.returncode, "".join(lines)) for proc, lines in zip(procs, outputs)]


def test_sigterm_to_one_mesh_worker_stops_both_at_one_step_and_the_same_command_resumes(
        tmp_path):
    # Only worker 1 is signalled: worker 0 stops at the same step because they agree
    # over the mesh, not because it got a signal of its own.
    ckpt = tmp_path / "ckpt"
    whole = _workers(tmp_path / "whole", tmp_path / "whole.json")
    reference = in_background(lambda: _finish(whole))
    stopped = _finish(_workers(ckpt, tmp_path / "run.json"), sigterm_worker=1)
    for worker, (status, output) in enumerate(stopped):
        assert status == 143, (worker, status, output[-3000:])
        for line in ("tfpar: stopping at step 5 on SIGTERM: checkpoint saved",
                     "tfpar: preempted (SIGTERM): checkpoint saved at step 5"):
            assert line in output, (worker, output[-3000:])
    saved = sorted(name for name in os.listdir(ckpt) if name.endswith(".index"))
    assert saved == ["ckpt-5.index"], saved
    with open(tmp_path / "run.json") as f:
        first = json.load(f)
    # The same command again: it resumes at step 5 and ends as the uninterrupted job.
    for status, output in _finish(_workers(ckpt, tmp_path / "run.json")):
        assert status == 0, output[-3000:]
    with open(tmp_path / "run.json") as f:
        second = json.load(f)
    for status, output in reference.result():
        assert status == 0, output[-3000:]
    with open(tmp_path / "whole.json") as f:
        uninterrupted = json.load(f)
    assert first["steps"] == 5 and second["steps"] == 10, (first, second)
    assert first["loss_history"] + second["loss_history"] == uninterrupted["loss_history"]
    final = _tensors(str(ckpt / "ckpt-15"))
    expected = _tensors(str(tmp_path / "whole" / "ckpt-15"))
    assert sorted(final) == sorted(expected)
    assert any("optimizer" in name for name in final), sorted(final)  # Adam's slots
    for name, value in expected.items():
        np.testing.assert_array_equal(final[name], value, name)
