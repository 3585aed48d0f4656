"""The planner's cost model against hand-computed cases, and its refusals."""

import json
import sys

import pytest

from subproc import run
from tfpar import ParallelConfig
from tfpar.errors import ConfigError, TfparError
from tfpar.plan import cost, planner

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
