"""ZeRO stages 1 and 2 on data parallelism (`tfpar.zero`, `--zero_stage`).

Each test runs one child process (tests/zero_child.py) that trains several configurations
on one strategy. ZeRO changes where optimizer state lives and how gradients travel, not
the maths: weights after 5 steps must equal plain data parallelism on the same replicas
within 1e-6 (SGD with momentum) / 1e-5 (Adam), the optimizer state per device must shrink
to about 1/replicas, and a resumed run must end where the uninterrupted one does.
"""

import json
import os
import sys

import numpy as np
import pytest

from subproc import ROOT, last_json_line, run, run_concurrently, run_module
from subproc import max_diff, saved_arrays as weights  # noqa: F401 (imported)
from tfpar import ParallelConfig
from tfpar.errors import ConfigError

CHILD = os.path.join(ROOT, "tests", "zero_child.py")
BASE = {"steps": 5, "steps_per_epoch": 5, "verbose": 0, "global_batch_size": 32}
MOMENTUM = {"optimizer": "momentum", "learning_rate": 0.05}
ADAM = {"optimizer": "adam", "learning_rate": 1e-3}


def test_zero_1_equals_plain_data_parallel_on_4_replicas(tmp_path, report_measured):
    where = {**BASE, "strategy": "mirrored", "cpu_devices": 4}
    ckpt = str(tmp_path / "ckpt")
    # Adam's ZeRO update on dense weights is checked on the transformer (its dense layers,
    # and the embedding's gradient slices besides); the mlp with Adam is the plain run
    # stage 3 is compared with. Momentum on the mlp at every stage. One transformer block:
    # its attention and MLP dense layers are the ones a second block would repeat.
    cases = [{"name": f"{model}-{opt_name}-{stage}", **where, "model": model,
              **(MOMENTUM if opt_name == "momentum" else ADAM), "zero_stage": stage,
              **({"model_depth": 1} if model == "transformer" else {})}
             for model, opt_name, stages in (("mlp", "momentum", (0, 1, 2)),
                                             ("mlp", "adam", (0,)),
                                             ("transformer", "momentum", (0,)),
                                             ("transformer", "adam", (0, 1, 2)))
             for stage in stages]
    # Resume: mlp-momentum-1's 5 steps saved, then on to 10, against 10 uninterrupted steps.
    cases[1]["checkpoint_dir"] = ckpt
    long = {**where, "model": "mlp", **MOMENTUM, "zero_stage": 1, "steps": 10,
            "steps_per_epoch": 5}
    cases += [{"name": "whole", **long}, {"name": "resumed", **long, "checkpoint_dir": ckpt}]
    # Stage 3 runs on a DTensor mesh (one backend per process): a second child, at once.
    # Not the transformer with Adam: there plain tf.distribute Adam adds each embedding
    # gradient slice's square into v (Keras's sparse path, see tfpar.zero._adam) while the
    # mesh's gradient is dense (squared once), 7.9e-3 apart after 5 steps by the maths.
    mesh_cases = [{"name": f"{model}-{opt_name}-3", **BASE, "cpu_devices": 4, "model": model,
                   **(MOMENTUM if opt_name == "momentum" else ADAM), "zero_stage": 3,
                   **({"model_depth": 1} if model == "transformer" else {})}
                  for model, opt_name in (("mlp", "adam"), ("transformer", "momentum"))]
    prefix = str(tmp_path / "w")
    out, mesh_out = run_concurrently([
        lambda: run([sys.executable, CHILD, json.dumps(cases), prefix], timeout=600),
        lambda: run([sys.executable, CHILD, json.dumps(mesh_cases), prefix], timeout=600)])
    results = {**last_json_line(out.stdout), **last_json_line(mesh_out.stdout)}
    cases = mesh_cases + cases

    assert cases[3]["name"] == "mlp-momentum-1" and "checkpoint_dir" in cases[3]
    for case in cases[:-2]:
        name, stage = case["name"], case["zero_stage"]
        if stage == 0:
            continue
        plain = name[:-1] + "0"
        diff = max_diff(weights(f"{prefix}.{name}.npz"), weights(f"{prefix}.{plain}.npz"))
        tolerance = 1e-5 if case["optimizer"] == "adam" else 1e-6
        report_measured(f"zero: {name} vs plain, max |dw| after 5 steps = {diff:.2e}")
        assert diff <= tolerance, (name, diff)

    # ZeRO-3: parameters and optimizer state split over the 4 devices (a weight with no
    # dimension that divides by 4 stays whole: the mlp's 10-wide last bias).
    for model, opt_name in (("mlp", "adam"), ("transformer", "momentum")):
        sharded, plain = results[f"{model}-{opt_name}-3"], results[f"{model}-{opt_name}-0"]
        for key in ("param_bytes_per_device", "optimizer_state_bytes_per_device"):
            ratio = max(sharded[key]) / max(plain[key])
            report_measured(f"zero: stage 3 {key} / plain = {ratio:.3f} ({model}, 4 devices)")
            assert len(sharded[key]) == 4 and ratio <= 0.26, (model, key, sharded[key], plain[key])

    # Optimizer state lives where the pieces are: ~1/4 of plain on each of 4 devices.
    plain = results["mlp-momentum-0"]["optimizer_state_bytes_per_device"]
    for stage in (1, 2):
        sharded = results[f"mlp-momentum-{stage}"]["optimizer_state_bytes_per_device"]
        ratios = [s / p for s, p in zip(sharded, plain)]
        report_measured(f"zero: stage {stage} momentum state per device / plain = "
                        f"{max(ratios):.3f} (mlp, 4 replicas)")
        assert len(sharded) == 4 and max(ratios) <= 0.3, (sharded, plain)
        # Weights stay mirrored (stage 3 runs on a DTensor mesh).
        assert (results[f"mlp-momentum-{stage}"]["param_bytes_per_device"]
                == results["mlp-momentum-0"]["param_bytes_per_device"])

    assert results["resumed"]["resumed_from_step"] == 5
    # The same replicas, weights, sharded slots and data position: the same numbers.
    diff = max_diff(weights(f"{prefix}.resumed.npz"), weights(f"{prefix}.whole.npz"))
    assert diff == 0, f"resumed ZeRO-1 run differs from the uninterrupted one by {diff}"
    np.testing.assert_array_equal(results["resumed"]["loss_history"],
                                  results["whole"]["loss_history"][5:])


def test_zero_on_two_workers_equals_plain_two_workers(tmp_path):
    where = {**BASE, "strategy": "multi_worker", "cpu_devices": 2, "model": "mlp",
             **MOMENTUM}
    cases = [{"name": "plain", **where}, {"name": "zero1", **where, "zero_stage": 1},
             {"name": "zero2", **where, "zero_stage": 2}]
    prefix = str(tmp_path / "mw")
    out = run_module("tfpar.launch", "--workers=2", "--timeout=240", "--", sys.executable,
                     CHILD, json.dumps(cases), prefix, timeout=300)
    lines = [json.loads(line.split("] ", 1)[1]) for line in out.stdout.splitlines()
             if "] {" in line]
    assert [r["zero1"]["workers"] for r in lines] == [2, 2]
    assert [r["zero1"]["replicas"] for r in lines] == [4, 4]
    for name in ("zero1", "zero2"):
        w0 = weights(f"{prefix}.{name}.worker0.npz")
        assert max_diff(w0, weights(f"{prefix}.{name}.worker1.npz")) == 0.0, name
        assert max_diff(w0, weights(f"{prefix}.plain.worker0.npz")) <= 1e-6, name
        # Each worker's two devices hold a quarter of the state each (the list covers all
        # four devices; a worker counts only its own, the others' entries are 0).
        local = [b for b in lines[0][name]["optimizer_state_bytes_per_device"] if b]
        plain = [b for b in lines[0]["plain"]["optimizer_state_bytes_per_device"] if b]
        assert len(local) == len(plain) == 2 and max(local) <= 0.3 * min(plain), (local, plain)


@pytest.mark.parametrize("settings,match", [
    ({"zero_stage": 3, "compression": "topk"}, "compression='topk'.*reduce-scatter"),
    ({"zero_stage": 1, "compression": "auto"}, "compression='auto'.*powersgd"),
    ({"zero_stage": 1, "pipeline_stages": 2}, "zero_stage=1.*pipeline"),
    ({"zero_stage": 1, "tensor_parallel": 2}, "zero_stage=1.*DTensor"),
    ({"zero_stage": 2, "tensor_parallel": 2}, "zero_stage=2.*DTensor"),
    ({"zero_stage": 1, "keras": 2}, "zero_stage=1.*keras=2"),
])
def test_zero_refuses_what_it_does_not_compose_with(settings, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**settings)
    assert ParallelConfig(zero_stage=1, optimizer="adam").zero_stage == 1
    assert ParallelConfig(zero_stage=2, optimizer="adam").zero_stage == 2
    assert ParallelConfig(zero_stage=3, optimizer="adam", cpu_devices=4).zero_stage == 3


def test_zero_3_with_tensor_parallelism_equals_one_device(tmp_path, report_measured):
    # ZeRO-3 on a 2 x 2 mesh (data x tensor parallel): a weight the presets split over
    # `model` is split over `batch` on top; against one device, same seed and data.
    both = {**BASE, "zero_stage": 3, "cpu_devices": 4, "data_parallel": 2,
            "tensor_parallel": 2}
    one = {**BASE, "cpu_devices": 1, "strategy": "one_device"}
    models = {"mlp-adam": {"model": "mlp", **ADAM},
              "transformer-momentum": {"model": "transformer", "model_depth": 1, **MOMENTUM}}
    prefix = str(tmp_path / "tp")
    mesh_out, one_out = run_concurrently([
        lambda: run([sys.executable, CHILD, json.dumps(
            [{"name": f"{m}-z3tp", **both, **s} for m, s in models.items()]), prefix],
            timeout=600),
        lambda: run([sys.executable, CHILD, json.dumps(
            [{"name": f"{m}-one", **one, **s} for m, s in models.items()]), prefix],
            timeout=600)])
    results = {**last_json_line(mesh_out.stdout), **last_json_line(one_out.stdout)}
    for name in models:
        diff = max_diff(weights(f"{prefix}.{name}-z3tp.npz"), weights(f"{prefix}.{name}-one.npz"))
        tolerance = 1e-5 if "adam" in name else 1e-6
        report_measured(f"zero: stage 3 x tensor parallel 2 x 2 {name} vs one device, "
                        f"max |dw| after 5 steps = {diff:.2e}")
        assert diff <= tolerance, (name, diff)
        # Parameters and slots per device: about a quarter (a weight the presets keep
        # whole over `model` is split over `batch` alone; the mlp's 10-wide bias is whole).
        for key in ("param_bytes_per_device", "optimizer_state_bytes_per_device"):
            ratio = max(results[f"{name}-z3tp"][key]) / max(results[f"{name}-one"][key])
            report_measured(f"zero: stage 3 x tensor parallel {key} / one device = "
                            f"{ratio:.3f} ({name}, 4 devices)")
            assert ratio <= 0.3, (name, key, ratio)


def test_zero_3_with_fp16_loss_scaling_trains_as_fp16_data_parallel(tmp_path, report_measured):
    # ZeRO-3 (2-device mesh) with fp16 and Keras's LossScaleOptimizer against plain
    # tf.distribute data parallelism with fp16 on 2 replicas, same seed and data, 8 steps.
    # Not exact: measured 2026-12-05 (two runs), max |dw| 6.7e-4 (mlp) and 1.5-1.7e-4
    # (transformer) with momentum, weights up to 0.23 and 1.0: fp16 rounding (fp16's
    # epsilon is 9.8e-4), where it enters (which sum runs in 16 bits) not traced. A layer's recomputed forward casts
    # its weights to fp16 as its first forward did (`tfpar.patches.autocasting`).
    run_for = {**BASE, "steps": 8, "steps_per_epoch": 8, "mixed_precision": "fp16",
               "cpu_devices": 2, **MOMENTUM}
    models = {"mlp": {"model": "mlp"}, "transformer": {"model": "transformer",
                                                      "model_depth": 1}}
    prefix = str(tmp_path / "fp16")
    mesh_out, dp_out = run_concurrently([
        lambda: run([sys.executable, CHILD, json.dumps(
            [{"name": f"{m}-z3", **run_for, **s, "zero_stage": 3} for m, s in models.items()]),
            prefix], timeout=600),
        lambda: run([sys.executable, CHILD, json.dumps(
            [{"name": f"{m}-dp", **run_for, **s, "strategy": "mirrored"}
             for m, s in models.items()]
            # The same replay outside ZeRO: --recompute=full with fp16 (it failed with a
            # float32/float16 MatMul before the replay re-entered the autocast scope).
            + [{"name": "mlp-dp-recompute", **run_for, **models["mlp"],
                "strategy": "mirrored", "recompute": "full"}]), prefix], timeout=600)])
    results = {**last_json_line(mesh_out.stdout), **last_json_line(dp_out.stdout)}
    for name in models:
        diff = max_diff(weights(f"{prefix}.{name}-z3.npz"), weights(f"{prefix}.{name}-dp.npz"))
        z3, dp = results[f"{name}-z3"]["loss_history"], results[f"{name}-dp"]["loss_history"]
        report_measured(f"zero: stage 3 fp16 vs fp16 data parallel, {name}: max |dw| after "
                        f"8 steps = {diff:.2e}, final loss {z3[-1]:.4f} vs {dp[-1]:.4f}")
        assert diff <= 2e-3, (name, diff)
        np.testing.assert_allclose(z3, dp, rtol=1e-3)
    diff = max_diff(weights(f"{prefix}.mlp-dp-recompute.npz"), weights(f"{prefix}.mlp-dp.npz"))
    report_measured(f"recompute=full with fp16 vs without, mlp: max |dw| = {diff:.2e}")
    assert diff <= 1e-6, diff
