"""Asynchronous checkpoints (`--checkpoint_async`, the default): a save holds the state of
its own step although training goes on while it is written, and a worker killed inside
the write resumes from the checkpoint before it, ending where the uninterrupted run ends."""

import json
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from subproc import ROOT, in_background, last_json_line, popen, run, run_module
from test_train import CHILD, max_diff, weights

RUNS_CHILD = f"{ROOT}/tests/train_runs_child.py"
CONFIG = {"model": "mlp", "optimizer": "adam", "strategy": "one_device", "global_batch_size": 32,
          "steps": 30, "steps_per_epoch": 10, "checkpoint_every": 10, "verbose": 0}


@pytest.fixture
def busy_core():
    """Another process keeping a core busy while the test runs (killed after it)."""
    burner = popen([sys.executable, "-c", "while True: pass"], fresh=True)
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def _tensors(prefix):
    reader = tf.train.load_checkpoint(prefix)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def test_an_async_save_holds_the_state_of_its_step(tmp_path):
    # Both saves of step 10 wait 3 s before writing: the synchronous run waits in its step,
    # the asynchronous one trains on to step 30 meanwhile (30 steps take ~0.3 s); its
    # checkpoint must still hold step 10's weights, Adam slots and counters, bit for bit.
    for saved in _async_equals_sync(tmp_path, CONFIG).values():
        assert any("optimizer..Siteration" in k for k in saved)  # the optimizer's counter
    assert int(_tensors(str(tmp_path / "async" / "ckpt-10"))["step/.ATTRIBUTES/VARIABLE_VALUE"]) == 10


def test_an_async_save_holds_its_aggregators_state_of_its_step_under_load(tmp_path, busy_core):
    # A tf.distribute aggregator's state (PowerSGD's residuals and Qs, Adam's moments in
    # front of it, its step counter: per-replica variables) saved beside training, while
    # another process keeps a core busy: each checkpoint equals the synchronous run's of
    # the same step, tensor by tensor (an older tfpar saved such state synchronously).
    cfg = {**CONFIG, "strategy": "mirrored", "cpu_devices": 2, "compression": "powersgd",
           "powersgd_rank": 4, "adam_warmup_steps": 5}
    for saved in _async_equals_sync(tmp_path, cfg).values():
        codec = [k for k in saved if "codec..S" in k]
        assert {k.rsplit("..S", 1)[-1] for k in codec} >= {
            "residual", "powersgd_q", "adam_m", "adam_v", "step"}, codec


@pytest.mark.parametrize("codec", ["topk", "powersgd"])
def test_an_async_save_holds_zero12s_codec_state_of_its_step_under_load(tmp_path, codec,
                                                                       busy_core):
    # ZeRO-2 with a lossy codec, 2 replicas: its own reduce-scatter's residual (top-k), or
    # its aggregator's residuals, Qs and step counter (PowerSGD), and the sharded slots,
    # saved beside training under load (an older tfpar saved ZeRO's codec state
    # synchronously): each checkpoint equals the synchronous run's of the same step.
    # Adam behind the codec (Adam in front keeps data parallelism's state, saved as its).
    cfg = {**CONFIG, "strategy": "mirrored", "cpu_devices": 2, "zero_stage": 2,
           "compression": codec, "topk_union": False, "powersgd_rank": 4,
           "compress_adam_step": False}
    kinds = {"topk": {"residual"}, "powersgd": {"residual", "powersgd_q", "step"}}[codec]
    for saved in _async_equals_sync(tmp_path, cfg).values():
        codec_keys = [k for k in saved if "codec..S" in k]
        assert {k.rsplit("..S", 1)[-1] for k in codec_keys} == kinds, codec_keys
        residual = [saved[k] for k in codec_keys if k.endswith("residual")]
        assert all(r.shape[0] == 2 for r in residual) and any(r.any() for r in residual)
        assert any(k.endswith("..Svelocity") for k in saved)  # Adam's sharded slots, whole


def _async_equals_sync(tmp_path, cfg):
    """`cfg` run twice, saving asynchronously and synchronously, step 10's write held 3 s
    in both: the same losses, and each checkpoint (steps 10, 20, 30) the same tensors, bit
    for bit. Returns `{step: the async checkpoint's tensors}`."""
    runs = [[mode, {**cfg, "checkpoint_dir": str(tmp_path / mode),
                    "checkpoint_async": mode == "async"}] for mode in ("async", "sync")]
    out = run([sys.executable, RUNS_CHILD, json.dumps(runs), str(tmp_path / "run")],
              env={"TFPAR_INJECT_SAVE_PAUSE": "10:3:before_writing"}, timeout=300)
    assert "save synchronously" not in out.stderr  # no fallback to a synchronous save
    assert out.stderr.count("pausing 3 s inside the checkpoint save of step 10") == 2
    result = last_json_line(out.stdout)
    assert result["async"]["loss_history"] == result["sync"]["loss_history"]
    checkpoints = {}
    for step in (10, 20, 30):
        saved = _tensors(str(tmp_path / "async" / f"ckpt-{step}"))
        expected = _tensors(str(tmp_path / "sync" / f"ckpt-{step}"))
        assert sorted(saved) == sorted(expected)
        for key, value in expected.items():
            np.testing.assert_array_equal(saved[key], value, f"ckpt-{step} {key}")
        checkpoints[step] = saved
    return checkpoints


def test_a_worker_killed_inside_an_async_write_resumes_from_the_save_before(tmp_path):
    cfg = {**CONFIG, "checkpoint_every": 5, "steps": 25}
    reference = in_background(lambda: run(
        [sys.executable, CHILD, json.dumps(cfg), str(tmp_path / "whole")], timeout=240))
    # Attempt 0: the write of step 10 waits before its first file, training goes on and the
    # worker kills itself after step 13, inside that write. Attempt 1: the write of step 15
    # waits after its files, before the state file names it; killed after step 18, inside
    # that write, in the pause or (on a loaded machine) while the files are still written.
    began = time.monotonic()
    out = run_module("tfpar.launch", "--workers=1", "--max_restarts=2", "--grace=2",
                     "--timeout=200", "--", sys.executable, CHILD,
                     json.dumps({**cfg, "checkpoint_dir": str(tmp_path / "ckpt")}),
                     str(tmp_path / "killed"),
                     env={"TFPAR_INJECT_FAULTS": "0:13,0:18",
                          "TFPAR_INJECT_SAVE_PAUSE": "10:120:before_writing,15:120"},
                     timeout=240)
    elapsed = time.monotonic() - began
    output = out.stdout + out.stderr
    for line in ("pausing 120 s inside the checkpoint save of step 10 (state copied, no file",
                 "killing this worker after step 13", "killing this worker after step 18"):
        assert line in output, output[-3000:]
    # Neither kill waited for its paused write: the steps went on beside it.
    assert elapsed < 120, elapsed
    result = json.loads([line for line in out.stdout.splitlines() if "] {" in line][-1]
                        .split("] ", 1)[1])
    # Attempt 1 resumed from step 5 (it reached its kill at step 18); attempt 2 from step
    # 10, the save attempt 1 published before the one cut short.
    assert result["resumed_from_step"] == 10 and result["steps"] == 15, output[-3000:]
    reference.result()
    assert max_diff(weights(str(tmp_path / "killed.worker0")), weights(str(tmp_path / "whole"))) \
        == 0.0


SNAPSHOT_CHILD = f"{ROOT}/tests/checkpoint_snapshot_child.py"
RESHARD_CHILD = f"{ROOT}/tests/reshard_child.py"
MESH = {"model": "mlp", "optimizer": "adam", "tensor_parallel": 2,
        "data_parallel": 2, "global_batch_size": 16, "steps_per_epoch": 4, "verbose": 0}


def test_a_snapshot_of_dtensors_is_written_from_host_memory(tmp_path):
    # A DVariable's save read in the caller's thread, whole, to host memory: the writer
    # thread writes one file of host tensors (a save run on the mesh writes one per
    # device) holding the values of the snapshot, not the ones assigned after it.
    out = last_json_line(run([sys.executable, SNAPSHOT_CHILD, str(tmp_path)],
                             timeout=120).stdout)
    assert out["any_dtensor"] is False
    assert out["on_mesh"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and out["plain"] == 3.0
    assert out["gathered"] == [[0, -1, -2, -3], [-4, -5, -6, -7]]
    assert out["files"] == ["ckpt-1.data-00000-of-00001", "ckpt-1.index"]


def test_a_mesh_async_save_holds_its_step_and_resumes_exactly(tmp_path):
    # dp2×tp2 on 4 logical CPUs, one process. Both saves of step 2 wait 3 s before writing:
    # the synchronous run inside its step, the asynchronous one beside steps 3 and 4. The
    # asynchronous checkpoints must equal the synchronous ones bit for bit, and a run
    # resumed from the asynchronous directory must continue as the uninterrupted run.
    def ckpt(name, **settings):
        return [name, {**MESH, "cpu_devices": 4, "checkpoint_dir": str(tmp_path / name),
                       "checkpoint_every": 2, "keep_checkpoints": 5, **settings}, {}]
    runs = {"cpu_devices": 4, "runs": [
        ["ref", {**MESH, "cpu_devices": 4, "steps": 8}, {}],
        ckpt("sync", steps=4, checkpoint_async=False),
        ckpt("async", steps=4, checkpoint_async=True),
        ["resumed", ckpt("async", steps=8, checkpoint_async=True)[1], {}]]}
    out = run([sys.executable, RESHARD_CHILD, json.dumps(runs), str(tmp_path / "out")],
              env={"TFPAR_INJECT_SAVE_PAUSE": "2:3:before_writing"}, timeout=400)
    assert out.stderr.count("pausing 3 s inside the checkpoint save of step 2") == 2, \
        out.stderr[-3000:]
    assert "save synchronously" not in out.stderr  # no fallback to a synchronous save
    result = last_json_line(out.stdout)
    assert result["async"]["loss_history"] == result["sync"]["loss_history"]
    for step in (2, 4):
        saved = _tensors(str(tmp_path / "async" / f"ckpt-{step}"))
        expected = _tensors(str(tmp_path / "sync" / f"ckpt-{step}"))
        assert sorted(saved) == sorted(expected)
        for key, value in expected.items():
            np.testing.assert_array_equal(saved[key], value, f"ckpt-{step} {key}")
    for step in (2, 4, 6, 8):  # written on the host, not by the mesh's devices
        assert (tmp_path / "async" / f"ckpt-{step}.data-00000-of-00001").exists()
    assert int(_tensors(str(tmp_path / "async" / "ckpt-2"))["step/.ATTRIBUTES/VARIABLE_VALUE"]) == 2
    resumed = result["resumed"]
    assert resumed["resumed_from_step"] == 4
    assert resumed["loss_history"] == result["ref"]["loss_history"][4:]


def test_a_mesh_worker_killed_inside_an_async_write_resumes_from_the_save_before(tmp_path):
    # dp2×tp2 over 2 processes of 2 logical CPUs (DTensor's multi-client mesh). The write
    # of step 4 waits 900 s before its first file on both workers, longer than any timeout
    # here: the job finishes only if the steps go on beside it. Worker 0 kills itself after
    # step 5, inside that write. The restart resumes from step 2 (published before step 4's
    # save began) and ends where the uninterrupted job ends.
    cfg = {**MESH, "cpu_devices": 2, "steps": 8, "checkpoint_every": 2,
           "collective_timeout_s": 60}

    def launch(name, settings, env=None, restarts=0):
        return run_module("tfpar.launch", "--workers=2", f"--max_restarts={restarts}",
                          "--grace=2", "--timeout=300", "--", sys.executable, CHILD,
                          json.dumps(settings), str(tmp_path / name), env=env, timeout=420)
    reference = in_background(lambda: launch("whole", cfg))
    out = launch("killed", {**cfg, "checkpoint_dir": str(tmp_path / "ckpt")}, restarts=1,
                 env={"TFPAR_INJECT_FAULTS": "0:5",
                      "TFPAR_INJECT_SAVE_PAUSE": "4:900:before_writing"})
    output = out.stdout + out.stderr
    for line in ("pausing 900 s inside the checkpoint save of step 4 (state copied, no file",
                 "killing this worker after step 5"):
        assert line in output, output[-3000:]
    results = [json.loads(line.split("] ", 1)[1]) for line in out.stdout.splitlines()
               if line.startswith("[worker ") and "] {" in line]
    assert [r["resumed_from_step"] for r in results] == [2, 2], output[-3000:]
    reference.result()
    for worker in (0, 1):
        assert max_diff(weights(str(tmp_path / f"killed.worker{worker}")),
                        weights(str(tmp_path / f"whole.worker{worker}"))) == 0.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux")
def test_a_niced_writer_lowers_its_own_thread_only():
    # `Writer(nice=19)`: the write runs at the lowest priority (TensorFlow's save runs in
    # the calling thread: all of its CPU time is that thread's), training's thread keeps
    # its own.
    import os
    import threading

    from tfpar.checkpoint_writer import Writer

    def priority():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen, before = {}, priority()
    for nice in (0, 19):
        writer = Writer(nice=nice)
        writer.submit(1, lambda nice=nice: seen.update({nice: priority()}))
        writer.wait()
    assert seen == {0: before, 19: 19} and priority() == before


@pytest.mark.parametrize("nice", [-5, 20, 1.5, "19", True])
def test_a_writer_nice_that_is_not_0_to_19_is_one_line(nice):
    # A negative value would put the writer ahead of training (as root); a float or a
    # string raised inside the thread and the save was lost without a word.
    from tfpar.checkpoint_writer import Writer
    from tfpar.errors import ConfigError

    with pytest.raises(ConfigError, match=r"writer_nice=.* must be an integer from 0"):
        Writer(nice=nice)

def test_a_layout_state_snapshot_reads_its_variables_and_holds_their_values_at_the_save(
        tmp_path):
    # A user's Keras model and Adam, no strategy. `LayoutState` gives its weights and
    # slots to the snapshot as reads (TensorFlow's copy-on-write keeps a read's values),
    # in one batched function from the second save on (the first reads one by one, then
    # the writer thread traces the function). After each snapshot the model trains a step
    # (Keras's Adam updates in place) and every variable is assigned anew; the file then
    # written holds the values at the snapshot, bit for bit, not the later ones.
    import keras

    from tfpar import patches, state

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = np.random.RandomState(0).randn(16, 6), np.random.RandomState(1).randn(16, 3)
    model.train_on_batch(x, y)
    layout_state = state.LayoutState(model)
    checkpoint, cache = tf.train.Checkpoint(state=layout_state), {}
    variables = [*model.weights, *model.optimizer.variables]
    for save in range(3):
        entries = layout_state.entries()
        at_save = {name: np.array(e[0]()) for name, e in entries.items()}
        snapshot = patches.checkpoint_snapshot(checkpoint, cache)
        model.train_on_batch(x, y)
        for v in variables:
            v.assign(v.numpy() + np.ones((), v.dtype) * 7)
        prefix = str(tmp_path / f"ckpt-{save}")
        patches.write_checkpoint(snapshot, prefix)
        written = _tensors(prefix)
        for name, value in at_save.items():
            np.testing.assert_array_equal(written[state.key(name)],
                                          value, f"save {save}: {name}")
            assert not np.array_equal(value, entries[name][0]()), name  # updated since
        patches.trace_checkpoint_reads(cache)
    # Every weight and slot was a deferred read, the second and third saves' in one call.
    deferred = {key for _, key, _ in cache["signature"]}
    assert {state.key(n) for n in at_save if n.startswith(("model/", "optimizer/"))} <= deferred
    assert cache.get("batched") == 2
