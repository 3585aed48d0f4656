"""Calibration: the cost model's per-unit costs fitted to short real training runs.

`tfpar.plan.cost.step_seconds` is linear in five kinds of cost of a `Hardware`: seconds
per FLOP, per step, per parameter updated, per pipeline action and per parameter an
aggregator encodes. `calibration_runs` picks a few layouts of the model being planned, at
batches other than the one being planned for (half and 4 times it), `measure_run` trains each
for a few steps with `python -m tfpar.train` in a child process, and `fit` solves for the
costs by non-negative least squares on the relative error. Links (bandwidth, latency) are
measured separately by `tfpar.plan.planner.calibrate`.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from tfpar.errors import TfparError
from tfpar.plan import cost

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = ("step_overhead", "update_seconds_per_param", "seconds_per_flop", "action_overhead")


def calibration_batches(global_batch, devices):
    """Two global batches other than `global_batch` (about half and 4 times it), each split
    evenly over `devices` replicas and 8 micro-batches."""
    unit = 8 * devices
    small = max(unit, global_batch // 2 // unit * unit)
    large = max(2 * unit, 4 * global_batch // unit * unit)
    if small == global_batch:
        small = 2 * global_batch
    return small, large


def calibration_runs(profile, devices, global_batch,
                     compressions=("fp16", "int8", "topk", "powersgd")):
    """The `(Candidate, global batch)` runs calibration measures: all-device data
    parallelism at two batches (compute against fixed costs), once per aggregator (their
    encode cost), and 2-stage pipelines at 2, 4 and 8 micro-batches at both batches (the
    per-action cost and the update of a smaller shard)."""
    small, large = calibration_batches(global_batch, devices)
    dp = lambda comp: cost.Candidate(devices, 1, 1, 1, comp)  # noqa: E731
    runs = [(dp("none"), small), (dp("none"), large)]
    if devices > 1:
        # Not top-k where it would send every tensor whole (its union's message outgrows
        # fp32's from 3 replicas at the default 25 %): no selection, nothing to measure.
        runs += [(dp(comp), small) for comp in compressions
                 if comp != "topk" or cost.compression_ratio(comp, profile, replicas=devices) > 1]
    # At both batches: one noisy run at one batch can make extra micro-batches look free.
    for batch in (small, large):
        for stages, micro in ((2, 2), (2, 4), (2, 8)):
            if devices % stages == 0 and stages <= profile.blocks:
                runs.append((cost.Candidate(devices // stages, 1, stages, micro, "none"), batch))
    return runs


def measure_run(config, candidate, global_batch, devices, steps=30, timeout=600):
    """Median seconds of a training step of `candidate` on `devices` logical CPUs, measured
    by `python -m tfpar.train` in a child process (a fresh TensorFlow per layout).

    Raises:
        TfparError: the run failed or timed out.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "metrics.json")
        cmd = [sys.executable, "-m", "tfpar.train", f"--model={config.model}",
               f"--model_width={config.model_width}", f"--model_depth={config.model_depth}",
               f"--optimizer={config.optimizer}", f"--schedule={config.schedule}",
               f"--global_batch_size={global_batch}", f"--cpu_devices={devices}",
               f"--data_parallel={candidate.data}", f"--compression={candidate.compression}",
               f"--steps={steps}", f"--steps_per_epoch={steps}", "--verbose=0",
               f"--metrics_json={path}"]
        if candidate.pipeline > 1:
            cmd += [f"--pipeline_stages={candidate.pipeline}",
                    f"--microbatches={candidate.microbatches}"]
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 cwd=ROOT, env=env)
        except subprocess.TimeoutExpired:
            raise TfparError(f"calibration run timed out after {timeout} s: "
                             f"{' '.join(cmd)}") from None
        if out.returncode:
            tail = out.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise TfparError(f"calibration run failed ({tail[0]}): {' '.join(cmd)}")
        with open(path) as f:
            return json.load(f)["step_time_ms"]["median"] / 1000


def with_cost(hw, name, value):
    """`hw` with one per-unit cost set: a `SHARED` name or `encode:AGGREGATOR`."""
    if name == "seconds_per_flop":
        return dataclasses.replace(hw, flops=1 / value if value else float("inf"))
    if name.startswith("encode:"):
        encode = dict(hw.encode_seconds_per_param)
        encode[name.split(":", 1)[1]] = value
        return dataclasses.replace(hw, encode_seconds_per_param=encode)
    return dataclasses.replace(hw, **{name: value})


def design_row(profile, hw, candidate, global_batch, names):
    """The step time of `candidate` as `known + row · costs`: returns `(known, row)`, each
    coefficient read off `cost.step_seconds` with that cost at 1 and the others at 0."""
    zero = hw
    for name in names:
        zero = with_cost(zero, name, 0.0)
    known = cost.step_seconds(profile, zero, candidate, global_batch)[0]
    row = [cost.step_seconds(profile, with_cost(zero, name, 1.0), candidate,
                             global_batch)[0] - known for name in names]
    return known, row


def nonnegative_lstsq(a, b):
    """Least squares `a x ≈ b` with `x >= 0`: drops the most negative unknown (fixing it
    at 0) and solves again until none is negative. Fine for a handful of unknowns."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (sol >= 0).all():
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return x


def fit(profile, hw, observations):
    """Fits the per-unit costs of `hw` to measured step times.

    Args:
        profile: the model's `cost.Profile`.
        hw: the `Hardware` with measured links; its costs are the starting values, kept for
            any cost no observation depends on.
        observations: `(Candidate, global_batch, measured_seconds)` triples.

    Returns:
        `(hardware, predicted_seconds)`: the fitted `Hardware` and its prediction of each
        observation. Residuals are relative (each row divided by its measurement).
    """
    aggregators = sorted({c.compression for c, _, _ in observations} - {"none"})
    names = list(SHARED) + [f"encode:{a}" for a in aggregators]
    known, rows, weights = [], [], []
    for candidate, batch, seconds in observations:
        k, row = design_row(profile, hw, candidate, batch, names)
        known.append(k)
        rows.append(row)
        weights.append(1 / seconds)
    a = np.asarray(rows) * np.asarray(weights)[:, None]
    b = (np.array([s for _, _, s in observations]) - np.asarray(known)) * weights
    used = np.abs(a).sum(axis=0) > 0
    x = np.zeros(len(names))
    # Scale columns to unit norm: seconds per FLOP and seconds per step differ by 1e10.
    scale = np.linalg.norm(a[:, used], axis=0)
    x[used] = nonnegative_lstsq(a[:, used] / scale, b) / scale
    fitted = hw
    for name, value, free in zip(names, x, used):
        if free:
            fitted = with_cost(fitted, name, float(value))
    predicted = [cost.step_seconds(profile, fitted, c, batch)[0]
                 for c, batch, _ in observations]
    return fitted, predicted
