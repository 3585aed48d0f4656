"""Asynchronous checkpoints (`--checkpoint_async`, the default): a save holds the state of
its own step although training goes on while it is written, and a worker killed inside
the write resumes from the checkpoint before it, ending where the uninterrupted run ends."""

import json
import sys
import time

import numpy as np
import tensorflow as tf

from subproc import ROOT, in_background, last_json_line, run, run_module
from test_train import CHILD, max_diff, weights

RUNS_CHILD = f"{ROOT}/tests/train_runs_child.py"
CONFIG = {"model": "mlp", "optimizer": "adam", "strategy": "one_device", "global_batch_size": 32,
          "steps": 30, "steps_per_epoch": 10, "checkpoint_every": 10, "verbose": 0}


def _tensors(prefix):
    reader = tf.train.load_checkpoint(prefix)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def test_an_async_save_holds_the_state_of_its_step(tmp_path):
    # Both saves of step 10 wait 3 s before writing: the synchronous run waits in its step,
    # the asynchronous one trains on to step 30 meanwhile (30 steps take ~0.3 s); its
    # checkpoint must still hold step 10's weights, Adam slots and counters, bit for bit.
    runs = [[mode, {**CONFIG, "checkpoint_dir": str(tmp_path / mode),
                    "checkpoint_async": mode == "async"}] for mode in ("async", "sync")]
    out = run([sys.executable, RUNS_CHILD, json.dumps(runs), str(tmp_path / "run")],
              env={"TFPAR_INJECT_SAVE_PAUSE": "10:3:before_writing"}, timeout=300)
    assert out.stderr.count("pausing 3 s inside the checkpoint save of step 10") == 2
    result = last_json_line(out.stdout)
    assert result["async"]["loss_history"] == result["sync"]["loss_history"]
    for step in (10, 20, 30):
        saved = _tensors(str(tmp_path / "async" / f"ckpt-{step}"))
        expected = _tensors(str(tmp_path / "sync" / f"ckpt-{step}"))
        assert sorted(saved) == sorted(expected)
        assert any("optimizer..Siteration" in k for k in saved)  # the optimizer's counter
        for key, value in expected.items():
            np.testing.assert_array_equal(saved[key], value, f"ckpt-{step} {key}")
    assert int(_tensors(str(tmp_path / "async" / "ckpt-10"))["step/.ATTRIBUTES/VARIABLE_VALUE"]) == 10


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
