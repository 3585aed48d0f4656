"""`--keras=2` on SIGTERM: both workers of a tf_keras job agree on a step, save and stop,
and the same command resumes to the uninterrupted job's weights, bit for bit.

The signal goes to the launcher as soon as both workers report their strategy built
(`TFPAR_READY`): the run's guard records it (`tfpar.preemption.hold_sigterm`) and stops at
the first agreed step, 5, whatever the timing (as `tests/test_faults.py` checks for Keras
3). Adam, so the checkpoint must carry the slots; the same world size before and after, so
the resumed job must equal the uninterrupted one exactly.
"""

import json
import os
import sys

from subproc import in_background, run_module, sigterm_when_ready
from test_faults import worker_summary
from test_train import BASE, CHILD, max_diff, weights

CFG = {**BASE, "keras": 2, "model": "mlp", "optimizer": "adam", "strategy": "multi_worker",
       "steps": 15, "steps_per_epoch": 15, "checkpoint_every": 1000}


def _launch(settings, prefix):
    return [sys.executable, "-m", "tfpar.launch", "--workers=2", "--grace=20",
            "--timeout=200", "--", sys.executable, CHILD, json.dumps(settings), prefix]


def test_sigterm_saves_a_keras2_job_and_the_same_command_resumes_it_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    settings = {**CFG, "checkpoint_dir": str(ckpt)}
    reference = in_background(lambda: run_module(
        "tfpar.launch", "--workers=2", "--timeout=200", "--", sys.executable, CHILD,
        json.dumps(CFG), str(tmp_path / "whole"), timeout=240))
    # both strategies built: signal at once
    output = sigterm_when_ready(_launch(settings, str(tmp_path / "stopped")), timeout=200)
    for worker in (0, 1):
        assert f"[worker {worker}] tfpar: stopping at step 5 on SIGTERM" in output, \
            output[-3000:]
    saved = [name for name in os.listdir(ckpt) if name.endswith(".index")]
    assert saved == ["ckpt-5.index"], (saved, output[-2000:])
    stopped = [worker_summary(output, i) for i in (0, 1)]
    assert [s["steps"] for s in stopped] == [5, 5], output[-2000:]
    # The same command again: it resumes at step 5 and ends as the uninterrupted job.
    out = run_module("tfpar.launch", "--workers=2", "--timeout=200", "--", sys.executable,
                     CHILD, json.dumps(settings), str(tmp_path / "resumed"), timeout=240)
    resumed = [worker_summary(out.stdout, i) for i in (0, 1)]
    assert [r["resumed_from_step"] for r in resumed] == [5, 5], out.stdout[-2000:]
    whole = worker_summary(reference.result().stdout, 0)
    assert resumed[0]["loss_history"] == whole["loss_history"][5:]
    for worker in (0, 1):
        assert max_diff(weights(str(tmp_path / f"resumed.worker{worker}")),
                        weights(str(tmp_path / f"whole.worker{worker}"))) == 0.0
