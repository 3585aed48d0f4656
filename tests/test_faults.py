"""Faults: a worker killed mid-run is restarted and the job ends where it would have."""

import json
import os
import sys

import numpy as np

from subproc import ROOT, run_module
from test_train import BASE, CHILD, max_diff, train_child, weights


def test_killed_worker_restarts_and_ends_equal_to_an_uninterrupted_run(tmp_path):
    cfg = {**BASE, "model": "mlp", "optimizer": "adam", "steps": 24, "steps_per_epoch": 8,
           "checkpoint_every": 5}
    _, reference = train_child(tmp_path, "ref", **{**cfg, "strategy": "one_device"})
    prefix = str(tmp_path / "mw")
    run_cfg = {**cfg, "strategy": "multi_worker", "checkpoint_dir": str(tmp_path / "ckpt")}
    out = run_module("tfpar.launch", "--workers=2", "--max_restarts=1", "--grace=2",
                     "--timeout=300", "--", sys.executable, CHILD, json.dumps(run_cfg), prefix,
                     env={"KILL_AT_STEP": "13", "KILL_WORKER": "1"}, timeout=360)
    assert "KILLING worker 1 after step 13" in out.stdout
    assert "1 restart" in out.stderr
    results = [json.loads(line.split("] ", 1)[1]) for line in out.stdout.splitlines()
               if "] {" in line]
    assert [r["resumed_from_step"] for r in results] == [10, 10]  # lost 3 <= checkpoint_every
    assert all(r["steps"] == 14 for r in results)
    w0, w1 = weights(prefix + ".worker0"), weights(prefix + ".worker1")
    assert max_diff(w0, w1) == 0.0
    assert max_diff(w0, weights(reference)) < 1e-6
