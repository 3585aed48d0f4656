"""A pipeline's global batch (or micro-batch) the replicas do not divide trains exactly
(`tfpar.replica_split` through `ParallelConfig.replica_split`'s micro-steps).

- tf.distribute pipeline, 3 replicas × 2 stages (6 logical CPUs), batch 64 in 4
  micro-batches: 22/21/21 real examples, each replica's batch padded to 24 (whole
  micro-batches of 6) with examples of weight zero, the real ones weighted 72/64; and the
  same with `grad_accum_steps=2` (batch 32, 2 micro-batches: 64 a step, padded to 24).
- mesh pipeline, dp=2 × tp=2 × pp=2 (8 logical CPUs), batch 30 in 2 micro-batches: 15/15,
  each replica padded to 16 (`tfpar.data.mesh_dataset` lays micro-batch i of both replicas
  side by side), the real ones weighted 32/30.

Each against one device on the same seed and data, 5 steps: weights within 1e-6, step
losses within 1e-5 (relative), held-out loss and accuracy within 1e-6 (not for the
accumulated run, whose held-out batch would be its global batch of 32). The same pipelines with the real examples weighted 1 (the
padding still 0) must miss (their gradient is 12.5 % and 6.7 % short).
"""

import json
import os
import sys

import numpy as np
import pytest

from subproc import ROOT, run, run_concurrently
from subproc import saved_arrays as weights
from test_train import max_diff

CHILD = os.path.join(ROOT, "tests", "mesh_uneven_child.py")
MLP = {"model": "mlp", "optimizer": "adam", "steps": 5, "steps_per_epoch": 5, "verbose": 0,
       "validation_steps": 1}
ONE_64 = {**MLP, "strategy": "one_device", "global_batch_size": 64}
ONE_30 = {**MLP, "strategy": "one_device", "global_batch_size": 30}
PIPE = {**MLP, "strategy": "mirrored", "cpu_devices": 6, "data_parallel": 3,
        "pipeline_stages": 2, "microbatches": 4, "global_batch_size": 64}
PIPE_ACC = {**PIPE, "microbatches": 2, "global_batch_size": 32, "grad_accum_steps": 2,
            "validation_steps": 0}
MESH_PIPE = {**MLP, "cpu_devices": 8, "data_parallel": 2, "tensor_parallel": 2,
             "pipeline_stages": 2, "microbatches": 2, "global_batch_size": 30}


def child(prefix, configs, *flags):
    out = run([sys.executable, CHILD, *flags, json.dumps(configs), prefix], timeout=400)
    return next(json.loads(line) for line in reversed(out.stdout.splitlines())
                if line.startswith("[{"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline_uneven")
    jobs = {"one": [ONE_64, ONE_30], "pipe": [PIPE, PIPE_ACC], "mesh": [MESH_PIPE]}
    names = list(jobs) + ["pipe_unweighted", "mesh_unweighted"]
    results = run_concurrently(
        [lambda n=n: child(str(folder / n), jobs[n]) for n in jobs]
        + [lambda n=n: child(str(folder / f"{n}_unweighted"),
                             [{**jobs[n][0], "validation_steps": 0}], "--unweighted")
           for n in ("pipe", "mesh")])
    return folder, dict(zip(names, results))


def test_the_splits_pad_whole_micro_batches():
    from tfpar import ParallelConfig
    split = ParallelConfig(**PIPE).replica_split(3)
    assert (split.counts, split.padded, split.microsteps) == ((22, 21, 21), 24, 4)
    split = ParallelConfig(**PIPE_ACC).replica_split(3)
    assert (split.counts, split.padded, split.microsteps) == ((22, 21, 21), 24, 4)
    split = ParallelConfig(**MESH_PIPE).replica_split(2)
    assert (split.counts, split.padded, split.weight) == ((15, 15), 16, 32 / 30)


@pytest.mark.parametrize("name,run_index,reference,what", [
    ("pipe", 0, 0, "tf.distribute pipeline, 3 replicas x 2 stages, batch 64, M=4"),
    ("pipe", 1, 0, "tf.distribute pipeline, 3 replicas x 2 stages, batch 32 x 2 accumulated, M=2"),
    ("mesh", 0, 1, "mesh pipeline dp=2 x tp=2 x pp=2, batch 30, M=2")])
def test_an_uneven_pipeline_equals_one_device(runs, name, run_index, reference, what,
                                              report_measured):
    folder, out = runs
    assert out[name][run_index]["replicas"] == (3 if name == "pipe" else 2)
    expected = weights(folder / f"one.{reference}.npz")
    diff = max_diff(expected, weights(folder / f"{name}.{run_index}.npz"))
    line = f"uneven pipeline batch: {what} vs one device, mlp adam, 5 steps: max |dw| = {diff:.1e}"
    if run_index == 0:
        wrong = max_diff(expected, weights(folder / f"{name}_unweighted.0.npz"))
        line += f"; real examples weighted 1: {wrong:.1e}"
    report_measured(line)
    assert diff < 1e-6
    np.testing.assert_allclose(out[name][run_index]["loss_history"],
                               out["one"][reference]["loss_history"], rtol=1e-5)
    # Held-out batches are padded the same way; the weighted loss ignores the padding.
    # (The accumulated run, whose held-out batch would be its global batch of 32, holds
    # out none.)
    if run_index == 0:
        held_out, expected_held_out = (out[name][run_index]["validation"],
                                       out["one"][reference]["validation"])
        assert abs(held_out["loss"] - expected_held_out["loss"]) < 1e-6
        assert abs(held_out["accuracy"] - expected_held_out["accuracy"]) < 1e-6
    if run_index == 0:
        assert wrong > 1e-5, wrong  # the checks above would catch the unweighted split


def test_a_dataset_function_on_the_mesh_pipeline_is_refused_before_tensorflow():
    # Its batches reach the mesh pipeline whole: 30 does not cut into 2 micro-batches × 2
    # replicas. The refusal is a row of the rulebook, not the first step's.
    from tfpar import ParallelConfig
    from tfpar.errors import ConfigError
    settings = {k: v for k, v in MESH_PIPE.items() if k not in ("steps", "steps_per_epoch")}
    with pytest.raises(ConfigError, match=r"^global_batch_size=30 is invalid: a --dataset "
                       r"function's batches .* = 4 equal pieces; use a multiple of 4"):
        ParallelConfig(**settings, dataset="user_data:global_batches")
    ParallelConfig(**settings)  # the generated data pads
    ParallelConfig(**{**settings, "global_batch_size": 32}, dataset="user_data:global_batches")
