"""CPU offload of the optimizer state (`tfpar.offload`, `--offload=optimizer`).

Offload moves where the slots live and where the update runs, not the maths: weights after
5 steps must equal the device-resident run on the same replicas (data parallelism, ZeRO 1
and 2, ZeRO's int8 reduce-scatter, fp16 loss scaling) within 1e-6 (momentum) / 1e-5
(Adam); the devices must hold no slots; a checkpoint written from the host must resume on
the devices and the other way round with the next steps equal to the uninterrupted run.
The runs are in child processes (tests/zero_child.py); the host formulas are checked
against Keras's own update in this process.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest

from subproc import ROOT, last_json_line, run, run_cli_cases, run_concurrently, run_module
from subproc import max_diff, saved_arrays as weights
from tfpar import ParallelConfig, offload
from tfpar.errors import ConfigError

CHILD = os.path.join(ROOT, "tests", "zero_child.py")
BASE = {"steps": 5, "steps_per_epoch": 5, "verbose": 0, "global_batch_size": 32,
        "strategy": "mirrored", "cpu_devices": 2}
MOMENTUM = {"optimizer": "momentum", "learning_rate": 0.05}
ADAM = {"optimizer": "adam", "learning_rate": 1e-3}


@pytest.mark.parametrize("name", ["adam", "momentum", "nesterov"])
def test_host_formulas_are_keras_update(name):
    rng = np.random.default_rng(0)
    start = rng.normal(size=[7, 5]).astype(np.float32)
    if name == "adam":
        opt = keras.optimizers.Adam(learning_rate=0.01)
    else:
        opt = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9,
                                   nesterov=name == "nesterov")
    var = keras.Variable(start)
    host_w, slots = start.copy(), [np.zeros_like(start) for _ in range(2)]
    for step in range(4):
        grad = rng.normal(size=start.shape).astype(np.float32)
        if name == "adam":
            t = np.float32(step + 1)
            alpha = np.float32(0.01) * np.sqrt(np.float32(1) - np.float32(0.999) ** t) / (
                np.float32(1) - np.float32(0.9) ** t)
            host_w -= offload.adam_step(*slots, grad, None, alpha, 0.9, 0.999, 1e-7)
        else:
            host_w += offload.momentum_step(slots[0], grad, 0.05, 0.9, name == "nesterov")
        opt.apply([grad], [var])
    np.testing.assert_allclose(host_w, var.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(slots[0], opt.variables[2].numpy(), rtol=0, atol=1e-6)


def test_host_step_skips_a_non_finite_gradient():
    host = offload.HostSlots(("momentum", "velocity"), {0: (3,)})
    opt = keras.optimizers.Adam()
    grad = np.array([1.0, np.nan, 2.0], np.float32)
    steps = host.step(opt, [0], True, False, np.float32(0.1), grad, np.zeros([0], np.float32))
    assert not steps[0].any() and not host.arrays["momentum"][0].any()
    steps = host.step(opt, [0], True, True, np.float32(0.1), grad * 0 + 1,
                      np.zeros([0], np.float32))
    assert steps[0].all() and host.arrays["velocity"][0].all()


def test_offload_equals_device_resident_run_and_checkpoints_cross(tmp_path, report_measured):
    cases = []
    for model, opt, stage, extra in (("mlp", MOMENTUM, 0, {}),
                                     ("transformer", ADAM, 0, {}),  # embedding slices
                                     ("transformer", ADAM, 1, {}),
                                     ("mlp", MOMENTUM, 2, {}),
                                     ("mlp", ADAM, 1, {"compression": "int8"}),
                                     ("mlp", ADAM, 0, {"mixed_precision": "fp16"})):
        for mode in ("none", "optimizer"):
            tag = "-".join([model, opt["optimizer"], str(stage), *extra.values(), mode])
            cases.append({"name": tag, **BASE,
                          "model": model, **opt, "zero_stage": stage, "offload": mode,
                          **({"model_depth": 1} if model == "transformer" else {}), **extra})
    # fp16 runs in the second child (which has the lighter load).
    resume_first = [c for c in cases if c.get("mixed_precision")]
    cases = [c for c in cases if not c.get("mixed_precision")]
    # Checkpoints: 5 steps offloaded resumed on the devices to 10, and the other way round,
    # against 10 uninterrupted steps (offload and device agree exactly, checked above).
    a, b = str(tmp_path / "from_host"), str(tmp_path / "from_device")
    long = {**BASE, "model": "mlp", **ADAM, "steps": 10}
    resume = [{"name": "whole", **long},
              {"name": "first-host", **long, "steps": 5, "offload": "optimizer",
               "checkpoint_dir": a},
              {"name": "resumed-device", **long, "checkpoint_dir": a},
              {"name": "first-device", **long, "steps": 5, "checkpoint_dir": b},
              {"name": "resumed-host", **long, "offload": "optimizer", "checkpoint_dir": b}]
    prefix = str(tmp_path / "w")
    out, out_resume = run_concurrently([
        lambda: run([sys.executable, CHILD, json.dumps(cases), prefix], timeout=900),
        lambda: run([sys.executable, CHILD, json.dumps(resume_first + resume), prefix],
                    timeout=900)])
    results = {**last_json_line(out.stdout), **last_json_line(out_resume.stdout)}

    for case in cases + resume_first:
        name = case["name"]
        if case["offload"] == "none":
            continue
        resident = name.replace("-optimizer", "-none")
        diff = max_diff(weights(f"{prefix}.{name}.npz"), weights(f"{prefix}.{resident}.npz"))
        tolerance = 1e-5 if case["optimizer"] == "adam" else 1e-6
        report_measured(f"offload: {name} vs on the devices, max |dw| after 5 steps = "
                        f"{diff:.2e}")
        assert diff <= tolerance, (name, diff)
        # The devices hold no slots (Keras's iteration and learning rate, the counter).
        state, host = (results[name]["optimizer_state_bytes_per_device"],
                       results[name]["offload"])
        resident_state = results[resident]["optimizer_state_bytes_per_device"]
        assert max(state) <= 64 < min(resident_state), (name, state, resident_state)
        assert host["host_state_bytes"] >= max(resident_state) - 64, (name, host)
        assert host["bytes_to_host_per_step"] > 0 and host["bytes_to_device_per_step"] > 0

    # Data parallel momentum: one gradient down, one step up per replica (2), fp32.
    params = 4 * sum(np.size(w) for w in weights(f"{prefix}.mlp-momentum-0-optimizer.npz"))
    host = results["mlp-momentum-0-optimizer"]["offload"]
    assert (host["bytes_to_host_per_step"], host["bytes_to_device_per_step"],
            host["host_state_bytes"]) == (params, 2 * params, params)

    assert results["resumed-device"]["resumed_from_step"] == 5
    assert results["resumed-host"]["resumed_from_step"] == 5
    whole = weights(f"{prefix}.whole.npz")
    for name in ("resumed-device", "resumed-host"):
        diff = max_diff(weights(f"{prefix}.{name}.npz"), whole)
        report_measured(f"offload: {name} after 10 steps vs uninterrupted = {diff:.2e}")
        assert diff <= 1e-5, (name, diff)
        np.testing.assert_allclose(results[name]["loss_history"],
                                   results["whole"]["loss_history"][5:], rtol=1e-5)


@pytest.mark.parametrize("settings,match", [
    ({"offload": "optimizer+params"}, "offload='optimizer\\+params'.*not built"),
    ({"offload": "optimizer", "optimizer": "sgd"}, "plain SGD keeps no optimizer state"),
    ({"offload": "optimizer", "compression": "topk"}, "compression='topk'.*--offload"),
    ({"offload": "optimizer", "zero_stage": 3, "cpu_devices": 4}, "offload='optimizer'.*DTensor"),
    ({"offload": "optimizer", "tensor_parallel": 2}, "offload='optimizer'.*DTensor"),
    ({"offload": "optimizer", "pipeline_stages": 2}, "offload='optimizer'.*pipeline"),
    ({"offload": "optimizer", "keras": 2}, "offload='optimizer'.*keras=2"),
    ({"offload": "optimizer", "optimizer": "momentum", "fused_update": True}, "fused_update"),
])
def test_offload_refuses_what_it_does_not_run_with(settings, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**settings)
    assert ParallelConfig(offload="optimizer", zero_stage=2, compression="int8").offload \
        == "optimizer"


def test_offload_on_two_workers_equals_the_device_resident_run(tmp_path):
    # Every worker's host keeps the whole state and computes the same update.
    where = {**BASE, "strategy": "multi_worker", "cpu_devices": 1, "model": "mlp", **ADAM}
    cases = [{"name": "devices", **where}, {"name": "host", **where, "offload": "optimizer"}]
    prefix = str(tmp_path / "mw")
    out = run_module("tfpar.launch", "--workers=2", "--timeout=240", "--", sys.executable,
                     CHILD, json.dumps(cases), prefix, timeout=300)
    lines = [json.loads(line.split("] ", 1)[1]) for line in out.stdout.splitlines()
             if "] {" in line]
    assert [r["host"]["workers"] for r in lines] == [2, 2]
    host = weights(f"{prefix}.host.worker0.npz")
    assert max_diff(host, weights(f"{prefix}.host.worker1.npz")) == 0.0
    assert max_diff(host, weights(f"{prefix}.devices.worker0.npz")) <= 1e-5


def test_offload_with_zero_across_workers_is_refused_before_tensorflow():
    from tfpar import compat, tf_config
    cluster = tf_config.parse(json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                                          "task": {"type": "worker", "index": 0}}))
    config = ParallelConfig(offload="optimizer", zero_stage=1, strategy="multi_worker")
    with pytest.raises(ConfigError, match="offload='optimizer'.*across worker processes"):
        compat.check_cluster(config, cluster)
    compat.check_cluster(config.replace(zero_stage=0), cluster)


def test_a_non_finite_step_is_skipped_on_the_host_or_stops(tmp_path):
    # Replica 0's batch of step 3 holds a NaN: skipped (the host slots untouched, training
    # goes on) or the run stops naming the step, with the state on the host.
    base = ["--dataset=user_data:sign_of_sum_nan_at_step_3", "--num_classes=2",
            "--cpu_devices=2", "--steps=30", "--verbose=0", "--learning_rate=0.01",
            "--optimizer=adam", "--offload=optimizer"]
    flags = {"skip": ["--on_nan=skip_step"], "skip_zero2": ["--on_nan=skip_step",
                                                            "--zero_stage=2"], "stop": []}
    outs = run_cli_cases([([*base, f"--metrics_json={tmp_path / name}.json", *more], None)
                          for name, more in flags.items()],
                         env={"PYTHONPATH": os.path.join(ROOT, "tests")}, timeout=300)
    for name, out in zip(flags, outs):
        if name == "stop":
            assert out.returncode == 2 and "Traceback" not in out.stderr
            assert "tfpar: error: gradients became non-finite at step 3" in out.stderr
            continue
        assert out.returncode == 0, out.stderr[-2000:]
        metrics = json.loads((tmp_path / f"{name}.json").read_text())
        assert metrics["skipped_steps"] == [3] and "offload" in metrics, name
        losses = metrics["loss_history"]
        assert np.all(np.isfinite(np.delete(losses, 3))), (name, losses)
        assert np.mean(losses[-5:]) < 0.8 * losses[0], (name, losses)
