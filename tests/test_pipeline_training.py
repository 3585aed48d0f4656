"""The pipeline under the trainer: `tfpar.train` with --pipeline_stages, alone and with
data-parallel replicas, against the single-device run.

Two children at once (tests/pipeline_runs_child.py) train every config here, one after the
other on one runtime per strategy (`tfpar.train.train(runtime=...)`, as
tests/train_runs_child.py does: a run on a runtime repeats a fresh process's run bit for
bit), and report per config losses, final weights, where the stage variables and optimizer
slots live, and the pipeline metrics block. The second child also forks the command-line
run (one TensorFlow import for both) and checks the settings that do not combine.
"""

import json
import os
import sys

import numpy as np
import pytest

from subproc import ROOT, last_json_line, outcome, run, run_concurrently

CHILD = os.path.join(ROOT, "tests", "pipeline_runs_child.py")

SGD = dict(optimizer="sgd", learning_rate=0.1, steps=3, verbose=0, global_batch_size=16)
PIPELINES = [("mlp", "1f1b", 1), ("transformer", "interleaved", 2), ("mlp", "zb_h1", 1)]
AGGREGATOR = dict(model="mlp", pipeline_stages=2, microbatches=4, cpu_devices=4,
                  data_parallel=2, **{**SGD, "steps": 12})


def _children(folder, metrics):
    """Child 1: the single-device runs (one per model) and the pipeline × 2 replicas runs;
    child 2: the aggregator's two runs and the refused combinations, with the CLI run
    forked beside them. Returns (child 1's runs, child 2's runs, the CLI's fork result),
    each the AssertionError its child failed with if it failed."""
    one = [(f"ref_{model}", dict(model=model, strategy="one_device", **SGD))
           for model in sorted({m for m, _, _ in PIPELINES})]
    pipes = [(f"pp_{model}_{schedule}", dict(model=model, pipeline_stages=2, microbatches=4,
                                              schedule=schedule, virtual_stages=V,
                                              cpu_devices=4, data_parallel=2, **SGD))
             for model, schedule, V in PIPELINES]
    # Accumulation: the schedule twice on 2 micro-batches of half the global batch (the
    # same 16 examples per step as pp_mlp_1f1b's 4 micro-batches).
    accum = [("pp_mlp_accum", dict(model="mlp", pipeline_stages=2, microbatches=2,
                                   grad_accum_steps=2, cpu_devices=4, data_parallel=2,
                                   **{**SGD, "global_batch_size": 8}))]
    aggregator = [("plain", AGGREGATOR), ("low", dict(compression="powersgd", powersgd_rank=8, **AGGREGATOR))]
    fp16 = [(name, {**settings, "mixed_precision": "fp16"})
            for name, settings in [("ref_fp16", dict(model="mlp", strategy="one_device", **SGD)),
                                   ("pp_fp16", dict(model="mlp", pipeline_stages=2,
                                                    microbatches=4, cpu_devices=4,
                                                    data_parallel=2, **SGD)),
                                   ("pp_fp16_accum", accum[0][1])]]
    cli = ["--pipeline_stages=2", "--microbatches=4", "--schedule=1f1b", "--cpu_devices=2",
           "--model=mlp", "--steps=40", "--steps_per_epoch=20",
           "--learning_rate=3e-3", "--verbose=0", f"--metrics_json={metrics}"]

    def child(configs, errors, cli):
        return last_json_line(run([sys.executable, CHILD, json.dumps(configs), str(int(errors)),
                                   json.dumps(cli), str(folder)], timeout=400).stdout)
    return run_concurrently([lambda: child(one + pipes + accum, False, None),
                             lambda: child(aggregator + fp16, True, cli)], keep_failures=True)


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline_training")
    return _children(folder, folder / "metrics.json") + [folder / "metrics.json"]


@pytest.fixture(scope="module")
def runs(children):
    return outcome(children[0])


@pytest.fixture(scope="module")
def forked(children):
    """Child 2's forks: {"runs": the aggregator runs and "errors", "cli": the CLI fork's
    result, "metrics": its metrics file}."""
    out = outcome(children[1])
    runs_fork = out["runs"]
    assert runs_fork["returncode"] == 0, runs_fork["stderr"][-3000:]
    return {"runs": last_json_line(runs_fork["stdout"]), "cli": out["cli"],
            "metrics": children[2]}


def _max_diff(a, b):
    assert len(a["weights"]) == len(b["weights"])
    return max(float(np.abs(np.array(x) - np.array(y)).max())
               for x, y in zip(a["weights"], b["weights"]))


@pytest.mark.parametrize("model,schedule,V", PIPELINES)
def test_pipeline_times_two_replicas_equals_single_device(runs, model, schedule, V):
    ref, pp = runs[f"ref_{model}"], runs[f"pp_{model}_{schedule}"]
    assert pp["replicas"] == 2
    # Replica r runs stage s on its own device; each stage's variables and optimizer
    # variables are mirrored over its two devices.
    assert pp["stage_devices"][:2] == [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]]
    assert pp["slot_devices"] == [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]]
    assert _max_diff(pp, ref) < 1e-6
    assert np.allclose(pp["loss"], ref["loss"], rtol=1e-5)
    assert pp["pipeline"]["stages"] == 2 and pp["pipeline"]["schedule"] == schedule
    # Every run measures its bubble on a sampled step (the profiler, first replica's ops):
    # each stage ran every action of the schedule, and it was idle part of the time. (A
    # zero-bubble W's ops carry its forward's name, so they show under B.)
    block = pp["pipeline"]
    assert 0 < block["bubble_measured"] < 1
    want = sorted(f"{k}{m}" + (f".{c}" if c else "") for k in "FB" for m in range(4)
                  for c in range(V))
    assert [sorted(a[0] for a in row) for row in block["timeline_measured"]["actions"]] \
        == [want, want]


def test_aggregator_composes_with_pipeline_and_replicas(forked):
    # Each stage aggregates its own gradients across the 2 replicas (PowerSGD: lossy, with
    # error feedback and a warm-started Q per stage); both replicas must apply the same
    # update to their copies, and training must follow the plain all-reduce closely.
    plain, low = forked["runs"]["plain"], forked["runs"]["low"]
    assert low["replica_spread"] == 0.0
    assert low["aggregator_devices"] == [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]]
    assert low["comm"]["compression_ratio"] > 5 * plain["comm"]["compression_ratio"]
    assert low["comm"]["bytes_uncompressed_per_step"] == plain["comm"]["bytes_on_wire_per_step"]
    assert np.mean(low["loss"][-4:]) < 0.9 * np.mean(low["loss"][:2])  # it learns
    assert abs(np.mean(low["loss"][-4:]) / np.mean(plain["loss"][-4:]) - 1) < 0.05


def test_trainer_cli_runs_the_pipeline(forked):
    cli = forked["cli"]
    assert cli["returncode"] == 0, cli["stderr"][-3000:]
    out = cli["stdout"]
    summary = [line for line in out.splitlines() if line.startswith("tfpar: ")][-1]
    result = json.loads(forked["metrics"].read_text())
    assert result["steps"] == 40 and result["replicas"] == 1
    losses = result["loss_history"]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), summary


def test_accumulation_equals_one_run_of_all_micro_batches_and_one_device(runs):
    # 2 runs of the schedule on 2 micro-batches each before one update = one run on 4 (the
    # same sums of the same micro-batch gradients), and both = one device.
    accum = runs["pp_mlp_accum"]
    assert accum["replicas"] == 2 and accum["pipeline"]["microbatches"] == 2
    assert _max_diff(accum, runs["pp_mlp_1f1b"]) < 1e-7
    assert _max_diff(accum, runs["ref_mlp"]) < 1e-6
    assert np.allclose(accum["loss"], runs["ref_mlp"]["loss"], rtol=1e-5)


def test_fp16_loss_scaling_in_the_pipeline_follows_one_device(forked, runs):
    # fp16 rounds each micro-batch's weight gradients where one device rounds the whole
    # batch's: 1.7e-5 measured after 3 SGD steps (2026-12-05); fp32 runs agree to 1e-6.
    runs, fp32 = forked["runs"], runs
    ref = runs["ref_fp16"]
    for name in ("pp_fp16", "pp_fp16_accum"):
        assert runs[name]["replicas"] == 2
        assert _max_diff(runs[name], ref) < 1e-4, name
        assert np.allclose(runs[name]["loss"], ref["loss"], rtol=1e-4), name
        assert runs[name]["replica_spread"] == 0.0
    assert _max_diff(runs["pp_fp16_accum"], runs["pp_fp16"]) < 1e-6
    # fp16 did run: the fp32 run on the same seed and data ends elsewhere.
    assert _max_diff(ref, fp32["ref_mlp"]) > 1e-4


def check_overflow_skipped(steps):
    """`pipeline_runs_child.fp16_overflow_steps`'s three steps (1F1B here, Chimera in
    tests/test_pipeline_chimera.py): the batch past fp16's range skipped as the
    unpipelined `LossScaleOptimizer` skips it."""
    good, bad, after = steps
    start = 2.0 ** 15  # LossScaleOptimizer's initial scale
    assert good["scales"] == {"ref": [start], "pipe": [start, start]}
    assert good["changed"] == {"ref": True, "pipe": True}
    # The batch past fp16's range: no stage updates, every stage halves its scale, as the
    # unpipelined LossScaleOptimizer does.
    assert bad["changed"] == {"ref": False, "pipe": False}
    assert bad["scales"] == {"ref": [start / 2], "pipe": [start / 2, start / 2]}
    assert after["changed"] == {"ref": True, "pipe": True}
    for step in steps:
        assert step["max_diff"] < 1e-4


def test_fp16_overflow_skips_the_step_on_every_stage(forked):
    out = forked["runs"]["fp16_overflow"]
    check_overflow_skipped(out["steps"])
    # One stage's overflow stops the other's update too; finite gradients pass unchanged.
    assert out["agreed_finite"] == [[False], [False]]
    assert out["kept"] == [[[1.0, 1.0]], [[1.0, 1.0, 1.0]]]


def test_skip_step_guard_skips_the_nan_step_on_every_stage(forked):
    # --on_nan=skip_step: the guard is copied to every stage's optimizer, the stages agree
    # on the step, and NaNGuard reads their count.
    out = forked["runs"]["nan_skip"]
    assert [s["changed"] for s in out["steps"]] == [[True, True], [False, False],
                                                    [True, True]]
    assert [s["counted"] for s in out["steps"]] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert out["skipped"] == [1]


def test_settings_that_do_not_combine_give_clear_errors(forked):
    out = forked["runs"]["errors"]
    assert out["per_replica"].startswith("ConfigError: microbatches=16 is invalid")
    assert "per-replica batch of 8" in out["per_replica"]
    assert "of a --dataset function" in out["per_replica"]
    assert out["devices"].startswith("ConfigError: pipeline_stages=3 is invalid")
    assert "need 6 devices, but 4 exist; use --data_parallel=1" in out["devices"]
