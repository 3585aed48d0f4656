"""`compression="lowbit"` (3 bits per entry) on issue 43's Embedding + LSTM + Adam model,
2 replicas, `tfpar.DistributedOptimizer` at its defaults: finite, near the plain Adam run,
~10x fewer bytes than fp32 (the child: tests/lowbit_child.py). Its codes' maths:
tests/test_compression_maths.py; its sums and error feedback on 4 replicas:
tests/test_compression_aggregators.py; its quality: tools/bench_compression_quality.py."""

import os
import sys

from subproc import ROOT, last_json_line, run

CHILD = os.path.join(ROOT, "tests", "lowbit_child.py")


def test_lowbit_trains_finite_near_plain_adam_at_a_tenth_of_the_bytes():
    r = last_json_line(run([sys.executable, CHILD], timeout=600).stdout)
    plain, low = r["plain"], r["lowbit"]
    assert low["finite"] and low["max_abs_weight"] < 3 * plain["max_abs_weight"], r
    # fit's running mean over the epoch: within 10 % of the plain run's.
    assert abs(low["final_loss"] / plain["final_loss"] - 1) < 0.1, r
    # 3 bit planes + one fp32 scale per 256 entries of each tensor; the last step compressed.
    assert low["comm"]["compression_ratio"] > 9.5, low["comm"]
