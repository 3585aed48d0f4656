"""Schedules as data: checked and simulated without TensorFlow."""

import subprocess
import sys

import pytest

from subproc import ROOT, child_env
from tfpar.errors import ConfigError
from tfpar.pipeline.schedule import (Action, ScheduleError, gpipe_schedule, make_schedule,
                                     one_f_one_b_schedule, simulate, theory_bubble)

CASES = [(name, K, M, 2 if name == "interleaved" else 1)
         for name in ("gpipe", "1f1b", "interleaved") for K in (2, 4) for M in range(1, 17)
         if name != "interleaved" or M % K == 0]


@pytest.mark.parametrize("name,K,M,V", CASES)
def test_schedule_is_complete_ordered_and_matches_theory(name, K, M, V):
    sched = make_schedule(name, K, M, V)
    for actions in sched:
        keys = [(a.kind, a.microbatch, a.chunk) for a in actions]
        # Each (mb, chunk) forward and backward exactly once per stage ...
        assert sorted(keys) == sorted((k, m, c) for k in "FB" for m in range(M)
                                      for c in range(V))
        # ... and every forward before its own backward.
        for m in range(M):
            for c in range(V):
                assert keys.index(("F", m, c)) < keys.index(("B", m, c))
    for f_cost, b_cost in ((1, 2), (1, 1)):
        sim = simulate(sched, K, M, V, f_cost, b_cost)  # raises on deadlock
        assert sim.bubble == pytest.approx(theory_bubble(K, M, V), abs=1e-12)
    # Cross-stage order in the timeline: forward of v after v-1, backward of v after v+1.
    end = {}
    for s, row in enumerate(sim.timeline):
        for a, start, stop in row:
            end[(a.kind, a.microbatch, a.chunk * K + s)] = (start, stop)
    for (kind, m, v), (start, _) in end.items():
        dep = ("F", m, v - 1) if kind == "F" else ("B", m, v + 1)
        if dep in end:
            assert end[dep][1] <= start
    if name == "1f1b":
        assert max(sim.peak_stash) <= K and sim.peak_stash[0] == min(K, M)
    if name == "gpipe":
        assert sim.peak_stash == [M] * K


@pytest.mark.parametrize("K", [2, 4])
def test_interleaved_bubble_below_1f1b(K):
    for M in range(K, 17, K):
        inter = simulate(make_schedule("interleaved", K, M, 2), K, M, 2).bubble
        plain = simulate(make_schedule("1f1b", K, M), K, M).bubble
        assert inter < plain
    assert theory_bubble(4, 8) == pytest.approx(3 / 11)
    assert theory_bubble(4, 8, 2) == pytest.approx(3 / 19)


def test_bad_schedules_are_named():
    with pytest.raises(ConfigError, match="microbatches=6.*multiple of pipeline_stages=4"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ConfigError, match="schedule='zb'"):
        make_schedule("zb", 2, 4)
    bad = one_f_one_b_schedule(2, 2)
    bad[1] = bad[1][:-1]
    with pytest.raises(ScheduleError, match="stage 1: action B1 is missing"):
        simulate(bad, 2, 2)
    bad[1] = one_f_one_b_schedule(2, 2)[1] + [Action("F", 0)]
    with pytest.raises(ScheduleError, match="F0 appears twice"):
        simulate(bad, 2, 2)
    # Stage 0 runs its backwards before its forwards: nothing can ever start.
    stuck = gpipe_schedule(2, 2)
    stuck[0] = stuck[0][2:] + stuck[0][:2]
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 waits at B0"):
        simulate(stuck, 2, 2)


def test_cli_prints_timeline_and_bubble():
    out = subprocess.run([sys.executable, "-m", "tfpar.pipeline.schedule", "--stages", "4",
                          "--microbatches", "8", "--schedule", "1f1b"], capture_output=True,
                         text=True, cwd=ROOT, env=child_env(), timeout=60, check=True).stdout
    assert out.count("stage ") == 4 and "bubble=0.273" in out and "peak_stash=[4, 3, 2, 1]" in out
    code = "import sys, tfpar.pipeline.schedule; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=child_env(), timeout=60, check=True).stdout
    assert out.strip() == "False"


def test_metrics_block_for_the_json():
    from tfpar.pipeline.schedule import pipeline_metrics
    assert pipeline_metrics("1f1b", 4, 8, bubble_measured=0.3) == {
        "stages": 4, "microbatches": 8, "schedule": "1f1b", "virtual_stages": 1,
        "bubble_theory": 3 / 11, "peak_stashed_microbatches": 4, "bubble_measured": 0.3}
    assert pipeline_metrics("gpipe", 2, 16)["peak_stashed_microbatches"] == 16


def test_simulate_takes_a_cost_per_stage():
    # GPipe, K=2, M=1: F 0-1 on stage 0, F 1-2 on stage 1, its backward 2-4, stage 0's 4-5.
    sim = simulate(gpipe_schedule(2, 1), 2, 1, 1, f_cost=[1, 1], b_cost=[1, 2])
    assert sim.makespan == 5 and sim.bubble == pytest.approx(0.5)
    # ZB-H1 with equal costs as lists equals the scalar theory; a shorter input-gradient
    # pass on stage 0 than on stage 1 (the peer model's 3 against 4 matmuls) leaves idle time.
    zb = make_schedule("zb_h1", 2, 8)
    assert simulate(zb, 2, 8, 1, [1, 1], [2, 2], [1, 1]).bubble == pytest.approx(
        theory_bubble(2, 8, 1, "zb_h1"))
    assert simulate(zb, 2, 8, 1, [4, 4], [7, 8], [4, 4]).bubble == pytest.approx(0.08)
