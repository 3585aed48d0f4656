"""Elastic launcher: a worker lost at a random step, the job shrinks, and grows back when
the slot is offered again.

`tfpar.launch --workers=2 --min_workers=1 --lost_after=1 --discovery=...`: worker slot 1
SIGKILLs itself at a random step after the first checkpoint (`TFPAR_INJECT_FAULTS`); the
launcher drops it and the survivor resumes alone from the last checkpoint (2 -> 1, same
global batch). The discovery command (`cat` of a file the test writes) stops listing the
slot, then lists it again while the lone worker is inside its save of step 40
(`TFPAR_INJECT_SAVE_PAUSE`, which keeps the moment of the offer off the timing of the
steps): the launcher sends SIGTERM, the worker stops at that step with a checkpoint, and the
job goes on with 2 workers from there (1 -> 2). It must end where the uninterrupted
2-worker job ends.
"""

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

import psutil

from subproc import ROOT, child_env, last_json_line, run_module
from test_train import CHILD

CFG = {"model": "mlp", "optimizer": "adam", "strategy": "multi_worker", "steps": 60,
       "steps_per_epoch": 20, "checkpoint_every": 10, "global_batch_size": 24,
       "verbose": 0, "collective_timeout_s": 60}
GROW_STEP, PAUSE_S = 40, 8


def _chief_line(stdout):
    lines = [line.split("] ", 1)[1] for line in stdout.splitlines()
             if line.startswith("[worker 0] {")]
    return last_json_line("\n".join(lines))


def test_worker_lost_then_offered_again_shrinks_and_grows_back(tmp_path, report_measured):
    seed = random.randrange(1 << 30)
    kill_step = random.Random(seed).randrange(CFG["checkpoint_every"] + 1,
                                              3 * CFG["checkpoint_every"])
    cfg = {**CFG, "checkpoint_dir": str(tmp_path / "ckpt"),
           "metrics_json": str(tmp_path / "metrics.json")}
    offers = tmp_path / "offers"
    offers.write_text("127.0.0.1:2\n")
    cmd = [sys.executable, "-m", "tfpar.launch", "--workers=2", "--min_workers=1",
           "--max_restarts=2", "--lost_after=1", "--grace=30", "--timeout=400",
           f"--discovery=cat {offers}", "--discovery_interval=0.5", "--",
           sys.executable, CHILD, json.dumps(cfg), str(tmp_path / "elastic")]
    env = child_env({"TFPAR_INJECT_FAULTS": f"1:{kill_step}",
                     "TFPAR_INJECT_SAVE_PAUSE": f"0:0,{GROW_STEP}:{PAUSE_S}"})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "worker slot 1 is lost" in line:
                offers.write_text("127.0.0.1:1\n")  # its machine is gone
            elif f"inside the checkpoint save of step {GROW_STEP}" in line:
                offers.write_text("127.0.0.1:2\n")  # and answers again

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=460)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    reader.join(timeout=5)
    output = "".join(lines)
    context = f"seed {seed}, kill at step {kill_step}\n{output[-4000:]}"
    assert proc.returncode == 0, context
    assert "worker slot 1 is lost" in output, context
    shrunk = re.search(r"training resumed at step (\d+) on 1 workers, ([\d.]+) s after the "
                       r"loss", output)
    assert shrunk, context
    step, seconds = int(shrunk.group(1)), float(shrunk.group(2))
    assert kill_step - CFG["checkpoint_every"] <= step <= kill_step, context  # repeated <= 10
    assert f"stopped at step {GROW_STEP} to grow: worker slot(s) 1 offered again" in output, \
        context
    grown = re.search(r"training resumed at step (\d+) on 2 workers, ([\d.]+) s after "
                      r"capacity returned", output)
    assert grown and int(grown.group(1)) == GROW_STEP, context  # no step repeated
    assert "world size 2 -> 1 -> 2" in output, context
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["elastic"] == [{"step": step, "workers": 1, "replicas": 1},
                                  {"step": GROW_STEP, "workers": 2, "replicas": 2}], context
    assert metrics["workers"] == 2
    alive = [p.pid for p in psutil.process_iter(["cmdline"])
             if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not alive, alive

    base = {**CFG, "checkpoint_dir": str(tmp_path / "ckpt_whole")}
    whole = run_module("tfpar.launch", "--workers=2", "--timeout=300", "--", sys.executable,
                       CHILD, json.dumps(base), str(tmp_path / "whole"), timeout=360)
    final = _chief_line(output)["final_loss"]
    reference = _chief_line(whole.stdout)["final_loss"]
    gap = abs(final - reference) / reference
    report_measured(f"elastic 2 -> 1 -> 2 workers (lost at step {kill_step}, seed {seed}): "
                    f"resumed on 1 at step {step} ({kill_step - step} steps repeated) "
                    f"{seconds:.1f} s after the loss was detected; grown back at step "
                    f"{GROW_STEP} (0 repeated) {float(grown.group(2)):.1f} s after the offer; "
                    f"final loss {final:.5f} vs {reference:.5f} uninterrupted ({gap:.3%})")
    assert gap <= 0.01, context
