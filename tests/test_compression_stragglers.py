"""A straggler: two workers (tfpar.launch), worker 1 lags 0.5 s before some steps, so worker
0 waits inside the aggregators' collectives. Every aggregator — PowerSGD with several
buckets before and after its start step, top-k, int8 — must neither crash nor corrupt: both
workers' final weights bit-equal and finite, and training still lowers the loss."""

import json
import sys

import numpy as np

from subproc import ROOT, run

AGGREGATORS = [
    # 12 KiB buckets: the MLP's plain all-reduce (steps < 4) goes in several collectives.
    {"compression": "powersgd", "powersgd_start_step": 4, "bucket_mb": 0.012},
    {"compression": "topk", "bucket_mb": 0.012},
    {"compression": "int8", "bucket_mb": 0.012},
]
BASE = {"model": "mlp", "strategy": "multi_worker", "global_batch_size": 32, "steps": 12,
        "steps_per_epoch": 12, "optimizer": "momentum", "learning_rate": 0.05, "seed": 3,
        "verbose": 0, "collective_timeout_s": 60.0}


def test_a_lagging_worker_neither_crashes_nor_corrupts(tmp_path):
    configs = [{**BASE, **a} for a in AGGREGATORS]
    prefix = str(tmp_path / "w")
    out = run([sys.executable, "-m", "tfpar.launch", "--workers=2", "--timeout=600", "--",
               sys.executable, f"{ROOT}/tests/straggler_child.py", json.dumps(configs), prefix],
              timeout=700).stdout
    lines = [line.split("] ", 1)[1] for line in out.splitlines()
             if line.startswith("[worker ") and "] [" in line]
    summaries = [json.loads(line) for line in lines]
    assert len(summaries) == 2, out[-3000:]
    lagged = {s_i: [r["lagged"] for r in s] for s_i, s in enumerate(summaries)}
    assert sorted(lagged.values()) == [[0, 0, 0], [5, 5, 5]], lagged  # one worker straggled
    for n, agg in enumerate(AGGREGATORS):
        w0 = np.load(f"{prefix}.worker0.{n}.npz")
        w1 = np.load(f"{prefix}.worker1.{n}.npz")
        for key in w0.files:
            assert np.isfinite(w0[key]).all(), (agg, key)
            assert np.array_equal(w0[key], w1[key]), f"{agg}: workers' {key} differ"
        losses = summaries[0][n]["loss_history"]
        assert summaries[1][n]["loss_history"] == losses
        assert np.isfinite(losses).all() and losses[-1] < losses[0], (agg, losses)
