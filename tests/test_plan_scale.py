"""The planner at scale: Megatron-LM's published layouts (Narayanan et al. 2021, Table 1),
and planning a trillion-parameter model in seconds and under 1 GB.

Hardware as published: A100 80 GB, 8 per node, NVLink 300 GB/s per direction per GPU
(2400 Gbit/s), 8 × 200 Gbit/s InfiniBand per node (200 Gbit/s per GPU), HBM 2039 GB/s.
One figure each for what the paper does not give, the same for all three models:
150 TFLOP/s sustained matmul rate (48 % of the 312 TFLOP/s fp16 peak; the paper reached
44-52 % end to end), 5 µs per ring-collective step. As the paper trained: sequence 2048,
vocabulary 51,200, mixed precision (2-byte activations, 16 bytes of state per parameter),
activation recomputation, gradients all-reduced in 16 bits (`compression=fp16` pins the
choice to none or fp16; the lossy aggregators are not what the paper ran).
tests/test_plan_scale.py prints each plan (pytest -s).
"""

import json
import os
import sys

import pytest

from subproc import ROOT, run
from tfpar.plan import planner, profile

PUBLISHED = [  # (layers, hidden, heads, GPUs, batch, (tensor, pipeline, data))
    (24, 2304, 24, 32, 512, (1, 1, 32)),
    (48, 8192, 64, 512, 1536, (8, 2, 32)),
    (128, 25600, 160, 3072, 3072, (8, 64, 6)),
]


def megatron_plan(layers, hidden, heads, gpus, batch, **changes):
    hw = planner.hardware_from(gpus, memory_gb=80, tflops=150, intra_gbps=2400,
                               inter_gbps=200, devices_per_machine=8, latency_us=5,
                               memory_gbps=2039)
    request = planner.Request(model=f"gpt-{layers}x{hidden}", trainer_builds_it=False,
                              global_batch_size=batch, mixed_precision="bf16",
                              recompute="on", compression="fp16", **changes)
    return planner.plan(profile.gpt_profile(layers, hidden, heads), hw, request)


@pytest.mark.parametrize("layers,hidden,heads,gpus,batch,published", PUBLISHED)
def test_published_layout_is_in_the_top_3(layers, hidden, heads, gpus, batch, published):
    result = megatron_plan(layers, hidden, heads, gpus, batch)
    print(planner.table(result, 5))
    top = [(r["tensor"], r["pipeline"], r["data"]) for r in result["layouts"][:3]]
    assert published in top, top
    row = next(r for r in result["layouts"]
               if (r["tensor"], r["pipeline"], r["data"]) == published)
    assert row["memory_bytes"] <= 80e9
    assert result["recommended"]["why"] and result["recommended"]["neighbours"]


def test_reasons_name_the_machine_boundary():
    result = megatron_plan(128, 25600, 160, 3072, 3072)
    crossing = [n for n in result["recommended"]["neighbours"] if "tp=32" in n]
    assert crossing and all("crosses the machine boundary" in n or "does not fit" in n
                            for n in crossing), crossing


def test_layouts_the_paper_could_not_use_do_not_fit():
    # 39.1 B with tensor = pipeline = 1: 16 B x 39.1 B = 626 GB of state per GPU.
    with pytest.raises(Exception, match="fits on no layout"):
        megatron_plan(48, 8192, 64, 512, 1536, tensor_parallel=1, pipeline_stages=1,
                      data_parallel=512)
    # 1008 B with the published tensor degree but a quarter of the stages: over 80 GB.
    with pytest.raises(Exception, match="fits on no layout"):
        megatron_plan(128, 25600, 160, 3072, 3072, tensor_parallel=8, pipeline_stages=16)


@pytest.mark.parametrize("flags", [
    # The command (it was killed at 24 GB building the model).
    ["--model=transformer", "--model_width=8192", "--model_depth=48", "--devices=64",
     "--devices_per_machine=8", "--memory_gb=80", "--tflops=300", "--intra_gbps=2400",
     "--inter_gbps=200", "--global_batch_size=512"],
    # The 1008 B shape (untied head: 1009 B parameters) on the paper's 3072 GPUs.
    ["--model=transformer", "--model_width=25600", "--model_depth=128", "--heads=160",
     "--seq_len=2048", "--vocab_size=51200", "--mixed_precision=bf16", "--devices=3072",
     "--devices_per_machine=8", "--memory_gb=80", "--tflops=150", "--intra_gbps=2400",
     "--inter_gbps=200", "--global_batch_size=3072"],
])
def test_planning_a_huge_model_takes_seconds_and_little_memory(flags):
    out = run([sys.executable, os.path.join(ROOT, "tests", "plan_rss_child.py"),
               sys.executable, "-m", "tfpar.plan", "--json", *flags], timeout=120)
    report = json.loads(out.stdout)
    assert report["returncode"] == 0, report["stderr"]
    print(f"{report['seconds']:.2f} s, peak {report['max_rss_mb']:.0f} MB")
    assert report["stdout"].startswith('{\n "model": "transformer"')
    assert report["seconds"] < 10 and report["max_rss_mb"] < 1024
