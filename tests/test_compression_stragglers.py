"""A straggler: two workers (tfpar.launch), worker 1 lags 0.5 s before some steps, so worker
0 waits inside the aggregators' collectives. Every aggregator — PowerSGD with several
buckets before and after its start step, top-k, int8 — must neither crash nor change a
number: both workers' final weights bit-equal, and weights and every step's loss bit-equal to
the same run without the lag (a lag only delays the collectives; anything it changed, a
straggler path that skipped, reordered or mixed up steps' contributions, would show)."""

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
    lagged = {i: [(r["lagged"]["lagged"], r["steady"]["lagged"]) for r in s]
              for i, s in enumerate(summaries)}
    # One worker straggled in the lagged runs, none in the steady ones.
    assert sorted(lagged.values()) == [[(0, 0)] * 3, [(5, 0)] * 3], lagged
    for n, agg in enumerate(AGGREGATORS):
        steady = np.load(f"{prefix}.worker0.{n}.steady.npz")
        for worker in (0, 1):
            w = np.load(f"{prefix}.worker{worker}.{n}.lagged.npz")
            for key in steady.files:
                assert np.array_equal(w[key], steady[key]), \
                    f"{agg}: worker {worker}'s {key} after the lagged run differs from the " \
                    f"steady run's (max |diff| {np.abs(w[key] - steady[key]).max()})"
            assert summaries[worker][n]["lagged"]["loss_history"] == \
                summaries[0][n]["steady"]["loss_history"], agg
        losses = summaries[0][n]["steady"]["loss_history"]
        assert np.isfinite(losses).all() and losses[-1] < losses[0], (agg, losses)
