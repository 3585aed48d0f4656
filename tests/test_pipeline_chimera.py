"""Chimera's bidirectional pipelines: the schedule as data (no TensorFlow) and the executor
against the single-device model (one child process, tests/pipeline_chimera_child.py)."""

import os
import sys

import pytest

from subproc import ROOT, last_json_line, run
from tfpar import ParallelConfig
from tfpar.errors import ConfigError
from tfpar.pipeline.schedule import (chimera_schedule, one_f_one_b_schedule, simulate,
                                     theory_bubble, virtual_stage)

CHILD = os.path.join(ROOT, "tests", "pipeline_chimera_child.py")


@pytest.mark.parametrize("K,M", [(2, 2), (2, 8), (3, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_schedule_runs_each_microbatch_one_way_and_beats_1f1b(K, M):
    sched = chimera_schedule(K, M)
    sim = simulate(sched, K, M)  # raises on a missing action or a deadlock
    for s, actions in enumerate(sched):
        # Even micro-batches go down (chunk 0, virtual stage s), odd ones up (K-1-s).
        assert sorted((a.kind, a.microbatch, a.chunk) for a in actions) == sorted(
            (k, m, m % 2) for k in "FB" for m in range(M))
        assert {virtual_stage(sched, s, a) for a in actions if a.chunk} == {K - 1 - s}
    # Its dependencies held in the simulated timeline: forward after the previous virtual
    # stage's, backward after the next one's.
    end = {(a.kind, a.microbatch, virtual_stage(sched, s, a)): (b, e)
           for s, row in enumerate(sim.timeline) for a, b, e in row}
    for (kind, m, p), (start, _) in end.items():
        dep = ("F", m, p - 1) if kind == "F" else ("B", m, p + 1)
        if dep in end:
            assert start >= end[dep][1]
    one_f = simulate(one_f_one_b_schedule(K, M), K, M)
    assert sim.bubble < one_f.bubble
    assert sim.bubble == theory_bubble(K, M, name="chimera")
    assert max(sim.peak_stash) <= K + 1


def test_two_stages_have_no_bubble():
    # K=2: each device starts one pipeline's first stage at once; nothing waits.
    assert simulate(chimera_schedule(2, 4), 2, 4).bubble == 0


def test_rulebook_rows():
    with pytest.raises(ConfigError, match="microbatches=3 is invalid: the chimera schedule "
                                          "sends half"):
        ParallelConfig(pipeline_stages=2, schedule="chimera", microbatches=3,
                       global_batch_size=48)
    with pytest.raises(ConfigError, match="schedule='chimera' is invalid: not supported on "
                                          "the mesh pipeline"):
        ParallelConfig(pipeline_stages=2, tensor_parallel=2, schedule="chimera",
                       microbatches=4, cpu_devices=4)
    with pytest.raises(ConfigError, match="zero_stage=1 is invalid"):
        ParallelConfig(pipeline_stages=2, schedule="chimera", microbatches=4, zero_stage=1)
    # Every codec and fp16 loss scaling: one aggregation per virtual stage (below).
    for codec in ("fp16", "int8", "topk", "powersgd", "auto"):
        ParallelConfig(pipeline_stages=2, schedule="chimera", microbatches=4,
                       compression=codec, mixed_precision="fp16", grad_accum_steps=2)
    assert ParallelConfig(pipeline_stages=2, schedule="chimera", microbatches=4).schedule \
        == "chimera"


@pytest.fixture(scope="module")
def child():
    return last_json_line(run([sys.executable, CHILD], timeout=600).stdout)


@pytest.mark.parametrize("case,tol", [("sgd/K2", 1e-6), ("adam/K2", 1e-5),
                                      ("sgd/K4", 1e-6), ("adam/K4", 1e-5),
                                      ("accum/adam/K2", 1e-5), ("recompute/adam/K2", 1e-5),
                                      ("residual/adam/K2", 1e-5)])
def test_weights_after_3_steps_equal_single_device(child, case, tol):
    got = child[case]
    assert got["moved"] > 1e-2  # the steps changed the weights
    assert got["weights"] < tol and got["predict"] < tol
    assert got["copies"] == 0  # both pipelines' copies of a stage: equal bit for bit


def test_keras_round_trip_and_metrics(child):
    stages, devices, diff = child["reload"]
    assert (stages, devices) == (4, 2) and diff == 0
    metrics = child["metrics"]
    assert metrics["schedule"] == "chimera" and metrics["bubble_theory"] == 0
    assert metrics["peak_stashed_microbatches"] == 3
    assert child["odd_microbatches"].startswith("ConfigError: microbatches=3 is invalid")


def test_checkpoint_holds_each_weight_once_and_loads_onto_both_schedules(child):
    state = child["state"]
    assert state["names"] == state["weights"]  # the second copies add no name
    assert state["1f1b"] == 0 and state["chimera"] == 0


def test_memory_estimate_holds_two_copies_and_the_simulated_stash():
    from tfpar.plan import cost
    from test_plan import HW, PROFILE as prof
    c = cost.Candidate(data=1, tensor=1, pipeline=2, microbatches=8, compression="none")
    # Two copies of half the params' weights and gradients (8 B/param each) and one Adam
    # state (8 B/param: only the first copy's optimizer updates) + 3 (= K + 1) stashed
    # micro-batches of 64/8 examples over half the layers (1F1B: one copy, 2 stashed).
    expected = (2 * 8 + 8) * 500_000 + 1e4 / 2 * (64 / 8) * 3
    assert cost.memory_bytes(prof, c, 64, "adam", "chimera") == pytest.approx(expected)
    assert all(m % 2 == 0 for m in {x.microbatches for x in cost.candidates(
        prof, HW, 64, schedule="chimera") if x.pipeline > 1})


# Chimera against 1F1B with the same codec, 2 stages x 2 replicas, 4 SGD steps (Adam:
# int8/adam). Each virtual stage's gradient is its two copies' halves summed, 1F1B's all
# micro-batches in turn: the sums differ in their last bits, and a quantizer may round a
# few entries one code apart (int8: 3.8e-6 with SGD, 1.3e-4 with Adam, which scales a
# small gradient up, in the run of 2026-12-05).
CODEC_RUNS = ["none", "fp16", "int8", "topk", "powersgd", "int8/adam", "mp_fp16/int8",
              "accum/topk"]


@pytest.fixture(scope="module")
def codecs():
    return last_json_line(run([sys.executable, CHILD, "codecs"], timeout=900).stdout)


@pytest.mark.parametrize("name", CODEC_RUNS)
def test_codec_runs_once_per_stage_and_matches_1f1b(codecs, name):
    import numpy as np
    one_f, chim, plain = codecs[f"{name}/1f1b"], codecs[f"{name}/chimera"], codecs["none/1f1b"]
    # Both copies of every weight, on both replicas: equal bit for bit.
    assert chim["spread"] == 0 and one_f["spread"] == 0
    tol = 5e-4 if "adam" in name else 1e-5
    assert np.abs(np.array(chim["weights"]) - np.array(one_f["weights"])).max() < tol
    assert np.allclose(chim["loss"], one_f["loss"], rtol=1e-4)
    # One aggregation per virtual stage: the bytes of 1F1B's stages, the codec's own.
    assert chim["comm"]["bytes_on_wire_per_step"] == one_f["comm"]["bytes_on_wire_per_step"]
    assert chim["comm"]["bytes_uncompressed_per_step"] \
        == plain["comm"]["bytes_uncompressed_per_step"]
    if name != "none":
        assert chim["comm"]["bytes_on_wire_per_step"] \
            < plain["comm"]["bytes_on_wire_per_step"]


@pytest.mark.parametrize("first,tol", [("chimera", 1e-6), ("1f1b", 1e-5)])
def test_codec_state_resumes_onto_chimera(codecs, first, tol):
    # PowerSGD's per-stage Q and residuals, checkpointed after 2 steps (by Chimera, or by
    # 1F1B: the same names) and resumed with Chimera, against its 4 uninterrupted steps.
    import numpy as np
    got, want = codecs[f"resume/{first}"], codecs["powersgd/chimera"]
    assert got["resumed_from_step"] == 2 and got["spread"] == 0
    assert np.abs(np.array(got["weights"]) - np.array(want["weights"])).max() < tol


def test_fp16_overflow_skips_the_step_on_both_copies(child):
    from test_pipeline_training import check_overflow_skipped
    check_overflow_skipped(child["fp16_overflow"])  # as 1F1B's, every stage's scale halved
    assert [step["copies"] for step in child["fp16_overflow"]] == [0, 0, 0]  # neither moved


def test_chimera_under_one_device_strategy_equals_1f1b(child):
    # `make_strategy("one_device")`, the model split and compiled in its scope: 3 SGD
    # steps of Chimera against 1F1B's in the same scope.
    got = child["one_device_strategy"]
    assert got["moved"] > 1e-2, got
    assert got["weights"] < 1e-6 and got["copies"] == 0, got

