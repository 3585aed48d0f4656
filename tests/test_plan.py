"""The planner's cost model against hand-computed cases, and its refusals."""

import dataclasses
import json
import sys

import pytest

from subproc import run
from tfpar import ParallelConfig
from tfpar.errors import ConfigError, TfparError
from tfpar.plan import calibration, cost, planner

PROFILE = cost.Profile(name="toy", params=1_000_000, flops_per_example=2e6,
                       activation_bytes_per_example=1e4, boundary_bytes_per_example=1e3,
                       blocks=4, tp_syncs_per_block=4, max_tensor_parallel=4,
                       matrix_shapes=((1000, 1000),))
HW = cost.Hardware(devices=4, memory_bytes=1e9, flops=1e12, intra_bandwidth=1e9,
                   inter_bandwidth=1e8, latency=0.0, action_overhead=0.0)


def test_ring_allreduce_time():
    # 2(n-1)/n * S / B: 4 peers, 100 MB at 1 GB/s -> 150 ms, plus 6 latencies
    assert cost.ring_allreduce_seconds(1e8, 4, 1e9) == pytest.approx(0.15)
    assert cost.ring_allreduce_seconds(1e8, 4, 1e9, latency=1e-3) == pytest.approx(0.156)
    assert cost.ring_allreduce_seconds(1e8, 1, 1e9) == 0.0


def test_bubble_formula():
    assert cost.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert cost.bubble_fraction(2, 4, virtual=2) == pytest.approx(1 / 9)


def test_memory_formula_adam_and_1f1b_stash():
    c = cost.Candidate(data=1, tensor=1, pipeline=2, microbatches=8, compression="none")
    # 16 B/param over half the params + activations of 2 (=K) micro-batches of 64/8 examples
    # over half the layers.
    expected = 16 * 500_000 + 1e4 / 2 * (64 / 8) * 2
    assert cost.memory_bytes(PROFILE, c, 64, "adam", "1f1b") == pytest.approx(expected)
    gpipe = 16 * 500_000 + 1e4 / 2 * (64 / 8) * 8
    assert cost.memory_bytes(PROFILE, c, 64, "adam", "gpipe") == pytest.approx(gpipe)


def test_step_time_data_parallel():
    c = cost.Candidate(data=4, tensor=1, pipeline=1, microbatches=1, compression="none")
    seconds, parts = cost.step_seconds(PROFILE, HW, c, 64)
    assert parts["compute"] == pytest.approx(3 * 2e6 * 16 / 1e12)
    assert parts["data_parallel"] == pytest.approx(1.5 * 4e6 / 1e9)
    assert seconds == pytest.approx(parts["compute"] + parts["data_parallel"])


def test_step_time_pipeline_bubble_matches_theory():
    c = cost.Candidate(data=1, tensor=1, pipeline=4, microbatches=8, compression="none")
    _, parts = cost.step_seconds(PROFILE, HW, c, 64)
    share = parts["bubble"] / (parts["bubble"] + parts["compute"])
    assert share == pytest.approx(cost.bubble_fraction(4, 8))


def test_compression_ratios():
    assert cost.compression_ratio("fp16", PROFILE) == 2.0
    assert cost.compression_ratio("topk", PROFILE) == pytest.approx(50.0)
    # rank 4 on a 1000x1000 matrix sends 8000 numbers; the other 0 params go raw
    assert cost.compression_ratio("powersgd", PROFILE) == pytest.approx(1e6 / 8000)


def test_candidates_pair_aggregators_with_replicas_only():
    layouts = set(cost.candidates(PROFILE, HW, global_batch=64))
    assert all(c.data * c.tensor * c.pipeline == 4 for c in layouts)
    assert cost.Candidate(4, 1, 1, 1, "powersgd") in layouts
    assert cost.Candidate(2, 1, 2, 4, "topk") in layouts  # each stage aggregates its own
    compressed = {c for c in layouts if c.compression != "none"}
    assert compressed and all(c.data > 1 and c.tensor == 1 for c in compressed)


def test_planner_recommends_a_layout_that_fits_and_its_command():
    hw = planner.hardware_from(devices=8, memory_gb=16, tflops=10, intra_gbps=100,
                               inter_gbps=10)
    result = planner.plan(ParallelConfig(model="transformer"), hw)
    best = result["recommended"]
    assert best["fits"] and best["data"] * best["tensor"] * best["pipeline"] == 8
    assert best["command"].startswith("python -m tfpar.train --model=transformer")
    assert result["ranked"][0]["step_seconds"] <= result["ranked"][-1]["step_seconds"]


def test_planner_refuses_impossible_requests():
    hw = planner.hardware_from(devices=4, memory_gb=0.0001, tflops=1, intra_gbps=1,
                               inter_gbps=1)
    with pytest.raises(TfparError, match="fits on no layout of 4 device"):
        planner.plan(ParallelConfig(model="transformer"), hw)
    with pytest.raises(ConfigError, match="pipeline_stages=.*at most"):
        planner.plan(ParallelConfig(model="mlp", pipeline_stages=9, microbatches=1), hw)
    with pytest.raises(ConfigError, match="devices"):
        planner.hardware_from(devices=0, memory_gb=1, tflops=1, intra_gbps=1, inter_gbps=1)


def test_cli_json_carries_the_command():
    out = run([sys.executable, "-m", "tfpar.plan", "--model=transformer", "--devices=8",
               "--json"], timeout=120)
    result = json.loads(out.stdout)
    assert "python -m tfpar.train" in result["recommended"]["command"]


def test_step_time_fixed_costs_and_encode_per_aggregator():
    hw = dataclasses.replace(HW, step_overhead=0.01, update_seconds_per_param=1e-9,
                             encode_seconds_per_param={"topk": 1e-8, "fp16": 2e-9})
    c = cost.Candidate(data=4, tensor=1, pipeline=1, microbatches=1, compression="topk")
    seconds, parts = cost.step_seconds(PROFILE, hw, c, 64)
    # 10 ms per step + 1 ns for each of the 1e6 parameters the device updates
    assert parts["overhead"] == pytest.approx(0.011)
    # top-k: 1e6 * 4 B / 50 on the wire, ring over 4 at 1 GB/s, + 10 ns per parameter
    assert parts["data_parallel"] == pytest.approx(1.5 * 8e4 / 1e9 + 0.01)
    assert seconds == pytest.approx(sum(parts.values()))
    fp16 = dataclasses.replace(c, compression="fp16")
    assert cost.step_seconds(PROFILE, hw, fp16, 64)[1]["data_parallel"] == pytest.approx(
        1.5 * 2e6 / 1e9 + 0.002)


def test_step_time_pipeline_action_overhead():
    hw = dataclasses.replace(HW, action_overhead=1e-3, update_seconds_per_param=1e-9)
    c = cost.Candidate(data=1, tensor=1, pipeline=2, microbatches=4, compression="none")
    _, parts = cost.step_seconds(PROFILE, hw, c, 64)
    # Per stage: 3 * 2e6 FLOPs * 64 examples / 2 stages at 1 TFLOP/s, over 4 micro-batches,
    # plus a forward and a backward action of 1 ms each: a slot of 0.048 + 2 ms.
    slot = 3 * 2e6 * 64 / 2 / 1e12 / 4 + 2e-3
    assert parts["compute"] == pytest.approx(4 * slot)
    assert parts["bubble"] == pytest.approx(slot)
    assert parts["overhead"] == pytest.approx(1e-9 * 500_000)
    # Logical devices sharing cores lend them to the busy stage during the bubble: only the
    # bubble's actions remain.
    shared = dataclasses.replace(hw, shared_cores=True)
    assert cost.step_seconds(PROFILE, shared, c, 64)[1]["bubble"] == pytest.approx(2e-3)
    # Without a pipeline there are no actions: a plain fit step.
    plain = cost.Candidate(data=4, tensor=1, pipeline=1, microbatches=1, compression="none")
    assert cost.step_seconds(PROFILE, hw, plain, 64)[1]["compute"] == pytest.approx(
        3 * 2e6 * 16 / 1e12)


def test_calibration_batches_avoid_the_planned_batch():
    assert calibration.calibration_batches(256, 4) == (128, 1024)
    for batch in (32, 64, 96, 256, 1000):
        small, large = calibration.calibration_batches(batch, 4)
        assert batch not in (small, large) and small % 32 == 0 and large % 32 == 0


def test_nonnegative_least_squares():
    # Unconstrained: x = (2, -1); with x >= 0 the second is dropped and the first refit.
    a = [[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]]
    b = [2.0, 1.0, 0.0]
    assert calibration.nonnegative_lstsq(a, b) == pytest.approx([1.0, 0.0])
    assert calibration.nonnegative_lstsq([[1.0, 0.0], [0.0, 1.0]], [3.0, 4.0]) == \
        pytest.approx([3.0, 4.0])


def test_fit_recovers_the_costs_that_made_the_step_times():
    truth = dataclasses.replace(
        HW, flops=2e11, shared_cores=True, step_overhead=0.02, update_seconds_per_param=3e-9,
        action_overhead=1.5e-3, latency=1e-4,
        encode_seconds_per_param={"fp16": 1e-9, "int8": 5e-9, "topk": 2e-8, "powersgd": 1e-8})
    runs = calibration.calibration_runs(PROFILE, 4, 256)
    assert {c.compression for c, _ in runs} == {"none", "fp16", "int8", "topk", "powersgd"}
    assert all(batch != 256 for _, batch in runs)
    observations = [(c, b, cost.step_seconds(PROFILE, truth, c, b)[0]) for c, b in runs]
    start = dataclasses.replace(HW, latency=1e-4, shared_cores=True)  # links measured
    fitted, predicted = calibration.fit(PROFILE, start, observations)
    assert fitted.flops == pytest.approx(2e11, rel=1e-6)
    assert fitted.step_overhead == pytest.approx(0.02, rel=1e-6)
    assert fitted.update_seconds_per_param == pytest.approx(3e-9, rel=1e-6)
    assert fitted.action_overhead == pytest.approx(1.5e-3, rel=1e-6)
    assert fitted.encode_seconds_per_param["topk"] == pytest.approx(2e-8, rel=1e-6)
    assert predicted == pytest.approx([s for _, _, s in observations], rel=1e-6)
    # The planned batch was never run, yet is predicted exactly.
    c = cost.Candidate(2, 1, 2, 4, "none")
    assert cost.step_seconds(PROFILE, fitted, c, 256)[0] == pytest.approx(
        cost.step_seconds(PROFILE, truth, c, 256)[0], rel=1e-6)
