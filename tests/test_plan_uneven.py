"""The planner offers layouts whose data-parallel degree does not divide the batch (the
trainer pads each replica's share, `tfpar.replica_split`) and charges them the padding's
compute."""

import dataclasses

import pytest

from test_plan import HW, PROFILE
from tfpar import ParallelConfig
from tfpar.plan import commands, cost, planner
from tfpar.train import check_inputs

THREE = dataclasses.replace(HW, devices=3)


def test_uneven_data_parallel_layouts_are_candidates_and_the_trainer_runs_them():
    layouts = set(cost.candidates(PROFILE, THREE, global_batch=64))
    dp3 = cost.Candidate(3, 1, 1, 1, "none")
    assert dp3 in layouts  # 64 over 3: 22/21/21
    # Micro-batch counts divide the global batch (the trainer's range) and stay within a
    # replica's share: 22 -> 1, 2, 4, 8, 16.
    assert {c.microbatches for c in layouts if (c.data, c.pipeline) == (3, 1)} == \
        {1, 2, 4, 8, 16}
    request = planner.Request(global_batch_size=64)
    assert commands.runnable(dp3, THREE, request) is None
    check_inputs(ParallelConfig(global_batch_size=64, data_parallel=3, cpu_devices=3,
                                strategy="mirrored"))


def test_the_padding_is_charged_as_compute():
    dp3 = cost.Candidate(3, 1, 1, 1, "none")
    assert cost.padded_batch(64, dp3) == 22 and cost.padded_batch(63, dp3) == 21
    assert cost.padding_fraction(64, dp3) == pytest.approx(66 / 64 - 1)
    assert cost.padding_fraction(63, dp3) == 0
    # The same layout on 64 examples computes 22 a replica, on 63 21: the compute part
    # grows by 22/21, not by 64/63.
    _, uneven = cost.step_seconds(PROFILE, THREE, dp3, 64)
    _, even = cost.step_seconds(PROFILE, THREE, dp3, 63)
    assert uneven["compute"] / even["compute"] == pytest.approx(22 / 21)
    # Micro-batches pad each share to whole micro-batches: 8 of 22 -> 24.
    assert cost.padded_batch(64, dataclasses.replace(dp3, microbatches=8)) == 24


def test_layouts_rank_by_their_padding_when_compute_decides():
    # Compute-bound (no communication cost): 64 over 4 replicas pads nothing, over 3 pads
    # 2 examples; the planner ranks dp=4 first on 4 devices and says the padding.
    hw = dataclasses.replace(HW, intra_bandwidth=1e30, inter_bandwidth=1e30)
    rows = planner.plan(PROFILE, hw, planner.Request(global_batch_size=64, data_parallel=0))
    best = rows["recommended"]
    assert (best["data"], best["padding"]) == (4, 0)
    request = planner.Request(global_batch_size=64)
    row = planner._row(PROFILE, THREE, cost.Candidate(3, 1, 1, 1, "none"), request)
    assert row["padding"] == pytest.approx(2 / 64)
    assert planner.label(row).endswith("padding 3%")
    uneven = cost.step_seconds(PROFILE, hw, cost.Candidate(3, 1, 1, 1, "none"), 64)[1]
    # Per device: 22 examples on 3 devices vs 16 on 4 (a larger, padded share).
    even = cost.step_seconds(PROFILE, hw, cost.Candidate(4, 1, 1, 1, "none"), 64)[1]
    assert uneven["compute"] / even["compute"] == pytest.approx(22 / 16)
