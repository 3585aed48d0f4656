"""PowerSGD's data-parallel step as `fit` traces it across two workers
(`MultiWorkerMirroredStrategy`, one CPU replica each; child tests/powersgd_step_child.py):
its collectives, and `--on_nan=stop`'s check reading the factors instead of the full sums.

PyTorch DDP's PowerSGD hook issues three collectives a step (the P's, the Q's, the rank-1
tensors); tfpar's step issues the P round (the uncompressed tensors with it) and the Q round
per group and Keras's one all-reduce of the step's logs (loss and metrics stacked, by
`tfpar.patches.multi_worker`): three with one group, as the hook. (Until 2026-12-06 a
fourth: tf.distribute's all-reduce of whether every worker's input still had a batch,
`get_next_as_optional`, made because the trainer's generated input was finite for
tf.data; it is declared endless now, `tfpar.data.pipeline_dataset`.) Static counts of the
traced step, which no machine load changes.
"""

import os
import sys

import pytest

from subproc import ROOT, run_tf_config_workers

WORKER = os.path.join(ROOT, "tests", "powersgd_step_child.py")


@pytest.fixture(scope="module")
def workers():
    return run_tf_config_workers(lambda i: [sys.executable, WORKER], 2, timeout=400)


@pytest.mark.parametrize("groups", [1, 2])
def test_two_rounds_a_group_and_the_logs_nothing_else(workers, groups):
    for w in workers:
        got = w[f"groups{groups}"]
        assert got["collectives"] == {"CollectiveReduceV2": 2 * groups + 1}, got
        rounds = [n for n in got["collective_nodes"] if "/sgd" in n]
        assert len(rounds) == 2 * groups, got  # the optimizer's: PowerSGD's rounds


@pytest.mark.parametrize("groups", [1, 2])
def test_no_pass_over_the_full_sums_on_an_ordinary_step(workers, groups):
    # The guard's pass (a `Sum` per gradient) only runs in the branch taken when the
    # factors cannot vouch for the sums; before, it ran on every step (none in a branch).
    for w in workers:
        got = w[f"groups{groups}"]
        assert got["sums"] - got["sums_outside_branches"] >= got["variables"], got
        # and not also outside them (a pass over every sum on every step)
        assert got["sums_outside_branches"] < got["variables"], got


def test_a_nan_on_one_worker_stops_both(workers):
    # Worker 1's batch of step 1 holds the NaN: its factors carry it into the sums, the
    # factors' check fails and the full pass finds it, on both workers. (Before 2026-12-06
    # only worker 0 made the pass: worker 1 trained on into a collective worker 0 had left.)
    for w in workers:
        assert w["nan_on_worker_1"].startswith(
            "gradients became non-finite at step 1 (on_nan=stop)"), w["nan_on_worker_1"]
