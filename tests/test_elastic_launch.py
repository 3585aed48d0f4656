"""Elastic launcher: a worker lost for good at a random step; the job goes on with the rest.

`tfpar.launch --workers=3 --min_workers=2`: worker slot 2 SIGKILLs itself at a random step
after the first checkpoint (`TFPAR_INJECT_FAULTS`), and in every later attempt exits at once
(its machine is gone). After --lost_after=2 failed attempts in a row the launcher drops it;
the two survivors resume from the last checkpoint with the same global batch, and the job
ends where the uninterrupted 3-worker job ends.
"""

import json
import random
import re
import sys

from subproc import last_json_line, run_module
from test_train import CHILD

CFG = {"model": "mlp", "optimizer": "adam", "strategy": "multi_worker", "steps": 60,
       "steps_per_epoch": 20, "checkpoint_every": 10, "global_batch_size": 24,
       "verbose": 0, "collective_timeout_s": 60}
# The lost machine: slot 2 exits at once from its second attempt on.
WRAPPER = ("import os, sys\n"
           "if os.environ['TFPAR_SLOT'] == '2' and os.environ['TFPAR_RESTART'] != '0':\n"
           "    sys.exit('worker slot 2: no machine')\n"
           "os.execv(sys.executable, [sys.executable] + sys.argv[1:])\n")


def _chief_line(stdout):
    lines = [line.split("] ", 1)[1] for line in stdout.splitlines()
             if line.startswith("[worker 0] {")]
    return last_json_line("\n".join(lines))


def test_worker_lost_for_good_job_completes_on_the_survivors(tmp_path, report_measured):
    seed = random.randrange(1 << 30)
    kill_step = random.Random(seed).randrange(CFG["checkpoint_every"] + 1,
                                              CFG["steps"] - CFG["checkpoint_every"])
    cfg = {**CFG, "checkpoint_dir": str(tmp_path / "ckpt"),
           "metrics_json": str(tmp_path / "metrics.json")}
    out = run_module(
        "tfpar.launch", "--workers=3", "--min_workers=2", "--max_restarts=3",
        "--lost_after=2", "--grace=2", "--timeout=420", "--", sys.executable, "-c", WRAPPER,
        CHILD, json.dumps(cfg), str(tmp_path / "elastic"),
        env={"TFPAR_INJECT_FAULTS": f"2:{kill_step}"}, timeout=480)
    context = f"seed {seed}, kill at step {kill_step}\n{out.stderr[-3000:]}"
    assert "worker slot 2 is lost" in out.stderr, context
    assert "world size 3 -> 2" in out.stderr, context
    resumed = re.search(r"training resumed at step (\d+) on 2 workers, ([\d.]+) s after",
                        out.stderr)
    assert resumed, context
    step, seconds = int(resumed.group(1)), float(resumed.group(2))
    assert kill_step - CFG["checkpoint_every"] <= step <= kill_step, context  # repeated <= 10
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["elastic"] == [{"step": step, "workers": 2, "replicas": 2}], context
    assert metrics["workers"] == 2

    base = {**CFG, "checkpoint_dir": str(tmp_path / "ckpt_whole")}
    whole = run_module("tfpar.launch", "--workers=3", "--timeout=300", "--", sys.executable,
                       CHILD, json.dumps(base), str(tmp_path / "whole"), timeout=360)
    final, reference = _chief_line(out.stdout)["final_loss"], _chief_line(
        whole.stdout)["final_loss"]
    gap = abs(final - reference) / reference
    report_measured(f"elastic 3 -> 2 workers (lost at step {kill_step}, seed {seed}): resumed "
                    f"at step {step} ({kill_step - step} steps repeated), {seconds:.1f} s from "
                    f"loss detected to training resumed; final loss {final:.5f} vs "
                    f"{reference:.5f} uninterrupted ({gap:.3%})")
    assert gap <= 0.01, context
