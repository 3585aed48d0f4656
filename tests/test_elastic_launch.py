"""Elastic launcher: a worker lost at a random step, the job shrinks, and grows back when
the slot is offered again.

`tfpar.launch --workers=2 --min_workers=1 --lost_after=1 --discovery=...`: worker slot 1
SIGKILLs itself at a random step after the first checkpoint (`TFPAR_INJECT_FAULTS`); the
launcher drops it and the survivor resumes alone from the last checkpoint (2 -> 1, same
global batch). The discovery command (`cat` of a file the test writes) stops listing the
slot, then lists it again while the lone worker is inside its save of step 40
(`TFPAR_INJECT_SAVE_PAUSE`, which keeps the moment of the offer off the timing of the
steps): the launcher sends SIGTERM, the worker stops at that step with a checkpoint, and the
job goes on with 2 workers from there (1 -> 2). Its last attempt's steps must have the
uninterrupted run's losses (the same training on 2 replicas in one process) within 1e-6
(relative) and end with its weights within 1e-6.

The issue's check: 4 workers at the default global batch 64 lose one for good and finish
on 3, which split the batch 22/21/21 (`tfpar.replica_split`), with the uninterrupted run's
losses and weights within 1e-5.
"""

import json
import os
import random
import re
import subprocess
import sys
import threading

import numpy as np
import psutil

from subproc import ROOT, in_background, last_json_line, popen, run
from subproc import max_diff as _gap, saved_arrays as _weights
from test_train import CHILD

# Synchronous saves: the pause inside the save of step 40 must hold the worker at that step
# (an asynchronous save pauses only its writer thread while training goes on). It lasts
# until the launcher's SIGTERM (`:until_sigterm`; a fixed 8 s until 2026-12-05), bounded.
CFG = {"model": "mlp", "optimizer": "adam", "strategy": "multi_worker", "steps": 60,
       "steps_per_epoch": 20, "checkpoint_every": 10, "global_batch_size": 24,
       "verbose": 0, "collective_timeout_s": 60, "checkpoint_async": False}
GROW_STEP, PAUSE_S = 40, 120


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
    # The uninterrupted run, meanwhile: the elastic job spends much of its time waiting (a
    # lost worker detected, restarts, a pause inside a save). Two replicas in one process
    # (`mirrored` over 2 logical CPUs) train what 2 workers train, the same global batches
    # (tests/test_train.py: 2 workers end within 1e-6 of one device), for one TensorFlow
    # start instead of two.
    base = {**CFG, "strategy": "mirrored", "cpu_devices": 2,
            "checkpoint_dir": str(tmp_path / "ckpt_whole")}
    whole_run = in_background(lambda: run(
        [sys.executable, CHILD, json.dumps(base), str(tmp_path / "whole")], timeout=360))
    offers = tmp_path / "offers"
    offers.write_text("127.0.0.1:2\n")
    cmd = [sys.executable, "-m", "tfpar.launch", "--workers=2", "--min_workers=1",
           "--max_restarts=2", "--lost_after=1", "--grace=30", "--timeout=400",
           f"--discovery=cat {offers}", "--discovery_interval=0.5", "--",
           sys.executable, CHILD, json.dumps(cfg), str(tmp_path / "elastic")]
    proc = popen(cmd, env={"TFPAR_INJECT_FAULTS": f"1:{kill_step}",
                           "TFPAR_INJECT_SAVE_PAUSE": f"0:0,{GROW_STEP}:{PAUSE_S}:until_sigterm"},
                 text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
    whole = whole_run.result()
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
                      r"the workers stopped to grow", output)
    assert grown and int(grown.group(1)) == GROW_STEP, context  # no step repeated
    assert "world size 2 -> 1 -> 2" in output, context
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["elastic"] == [{"step": step, "workers": 1, "replicas": 1},
                                  {"step": GROW_STEP, "workers": 2, "replicas": 2}], context
    assert metrics["workers"] == 2
    alive = [p.pid for p in psutil.process_iter(["cmdline"])
             if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not alive, alive

    chief, reference = _chief_line(output), last_json_line(whole.stdout)
    assert chief["resumed_from_step"] == GROW_STEP, context
    # The last attempt's steps (40..59) against the same steps of the uninterrupted run.
    losses = np.array(chief["loss_history"])
    same = np.array(reference["loss_history"][GROW_STEP:])
    gaps = np.abs(losses - same) / same
    weights = _gap(_weights(tmp_path / "elastic.worker0.npz"), _weights(tmp_path / "whole.npz"))
    report_measured(f"elastic 2 -> 1 -> 2 workers (lost at step {kill_step}, seed {seed}): "
                    f"resumed on 1 at step {step} ({kill_step - step} steps repeated) "
                    f"{seconds:.1f} s after the loss was detected; grown back at step "
                    f"{GROW_STEP} (0 repeated) {float(grown.group(2)):.1f} s after the stop; "
                    f"final loss {losses[-1]:.6f} vs {same[-1]:.6f} uninterrupted; steps "
                    f"{GROW_STEP}-{CFG['steps'] - 1}: largest relative loss gap "
                    f"{gaps.max():.1e}, final weights' largest gap {weights:.1e}")
    # Not bit for bit: the steps on one worker sum the batch's gradient in another order
    # than two replicas do, and Adam carries that float32 rounding on (measured: losses
    # 1.1e-7 apart, one ulp; weights 3.7e-8). A lost optimizer state or data position would
    # move the losses by percents.
    assert gaps.max() <= 1e-6, f"{gaps}\n{context}"
    assert weights <= 1e-6, f"{weights}\n{context}"


STAND_IN = os.path.join(ROOT, "tests", "elastic_launch_child.py")


def _fake_launch(tmp_path, workers, env, **kwargs):
    import io

    from tfpar.launch import launch
    out, err = io.StringIO(), io.StringIO()
    result = launch([sys.executable, STAND_IN, "worker", str(tmp_path)], workers,
                    env={**os.environ, **env}, out=out, err=err, grace=10, timeout=60,
                    discovery=f"{sys.executable} {STAND_IN} discovery {tmp_path}",
                    discovery_interval=0.1, **kwargs)
    return result, err.getvalue()


def test_a_lost_slot_comes_back_only_after_discovery_stopped_listing_it(tmp_path):
    # No TensorFlow: stand-in workers that print what the trainer prints. Slot 1 fails in
    # attempt 0 while discovery keeps listing it: it is lost, not taken back at once; the
    # lone worker makes discovery drop it once, and when it is listed again the launcher
    # stops the worker (SIGTERM) and continues with both.
    result, err = _fake_launch(tmp_path, 2, {"LOSE_SLOT": "1", "LAST_ATTEMPT": "2"},
                               min_workers=1, lost_after=1, max_restarts=1)
    assert result.returncode == 0, err
    assert [a.slots for a in result.attempts] == [(0, 1), (0,), (0, 1)], err
    assert "worker slot 1 is lost" in err
    assert "attempt 1: stopped at step 15 to grow: worker slot(s) 1 offered again" in err
    assert re.search(r"training resumed at step 20 on 2 workers, [\d.]+ s after the workers "
                     r"stopped to grow", err), err
    assert "world size 2 -> 1 -> 2" in err and "(3 attempt(s), 1 restart)" in err


def test_a_new_slot_grows_the_job_up_to_max_workers(tmp_path):
    result, err = _fake_launch(tmp_path, 1, {"LAST_ATTEMPT": "1"}, max_workers=2)
    assert result.returncode == 0, err
    assert [a.slots for a in result.attempts] == [(0,), (0, 1)], err
    assert "world size 1 -> 2" in err and "(2 attempt(s), 0 restarts)" in err


# The issue's check: 4 workers at the default global batch (64), one lost for good, the
# job finishes on 3 (64 = 22/21/21, `tfpar.replica_split`).
LOSE_ONE = {"model": "mlp", "optimizer": "adam", "strategy": "multi_worker", "steps": 30,
            "steps_per_epoch": 10, "checkpoint_every": 10, "verbose": 0,
            "collective_timeout_s": 60}


def test_four_workers_lose_one_for_good_and_finish_on_three(tmp_path, report_measured):
    seed = random.randrange(1 << 30)
    kill_step = random.Random(seed).randrange(LOSE_ONE["checkpoint_every"] + 1,
                                              2 * LOSE_ONE["checkpoint_every"])
    cfg = {**LOSE_ONE, "checkpoint_dir": str(tmp_path / "ckpt"),
           "metrics_json": str(tmp_path / "metrics.json")}
    # The uninterrupted 4-worker run as 4 replicas in one process (the same global
    # batches; the test above relies on workers = replicas in one process to 1e-6).
    base = {**LOSE_ONE, "strategy": "mirrored", "cpu_devices": 4}
    whole_run = in_background(lambda: run(
        [sys.executable, CHILD, json.dumps(base), str(tmp_path / "whole")], timeout=360))
    cmd = [sys.executable, "-m", "tfpar.launch", "--workers=4", "--min_workers=3",
           "--max_restarts=1", "--lost_after=1", "--grace=30", "--timeout=400", "--",
           sys.executable, CHILD, json.dumps(cfg), str(tmp_path / "elastic")]
    out = run(cmd, env={"TFPAR_INJECT_FAULTS": f"3:{kill_step}"}, timeout=460, check=False)
    whole = last_json_line(whole_run.result().stdout)
    output = out.stdout + out.stderr
    context = f"seed {seed}, kill at step {kill_step}\n{output[-4000:]}"
    assert out.returncode == 0, context
    assert "worker slot 3 is lost" in output and "world size 4 -> 3" in output, context
    assert "global batch kept at 64 (22/21/21 per replica)" in output, context
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["workers"] == 3 and metrics["replicas"] == 3, context
    assert metrics["elastic"] == [{"step": 10, "workers": 3, "replicas": 3}], context
    chief = _chief_line(out.stdout)
    # Every rank resumed at the same step and ran the same steps (Horovod's elastic Keras
    # state restored the wrong epoch on some ranks: its issue 2844).
    for i in range(3):
        rank = last_json_line("\n".join(line.split("] ", 1)[1] for line in
                                        out.stdout.splitlines()
                                        if line.startswith(f"[worker {i}] {{")))
        assert (rank["resumed_from_step"], rank["steps"], rank["workers"]) == (10, 20, 3), \
            context
        assert rank["loss_history"] == chief["loss_history"], context
    losses = np.array(chief["loss_history"])
    same = np.array(whole["loss_history"][10:])
    gaps = np.abs(losses - same) / same
    survivors = [_weights(tmp_path / f"elastic.worker{i}.npz") for i in range(3)]
    ranks = max(_gap(survivors[0], other) for other in survivors[1:])
    weights = _gap(survivors[0], _weights(tmp_path / "whole.npz"))
    report_measured(f"elastic 4 -> 3 workers, batch 64 (lost at step {kill_step}, seed "
                    f"{seed}): final loss {losses[-1]:.6f} vs {same[-1]:.6f} uninterrupted "
                    f"(relative gap {gaps[-1]:.1e}; largest over steps 10-29 "
                    f"{gaps.max():.1e}); final weights' largest gap {weights:.1e}; "
                    f"between the 3 ranks {ranks:.1e}")
    # The 3 replicas sum the same examples' gradients with the same weights as the 4 did
    # (padding at weight 0): the runs differ by float32 re-association only, carried on
    # by Adam (2 -> 1 workers above: 1.1e-7; here measured 8.7e-8, weights 3.0e-8). With
    # the real examples weighted 1 instead of 66/64 (a gradient 3 % short) this test
    # measured losses 3.0e-2 apart and weights 2.6e-3 (2026-12-05).
    assert gaps.max() <= 1e-5, f"{gaps}\n{context}"
    assert weights <= 1e-5, f"{weights}\n{context}"
    assert ranks == 0, context  # every rank holds the same weights after the resize
