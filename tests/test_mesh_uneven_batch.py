"""A global batch the mesh's `data_parallel` does not divide trains exactly on the mesh
(`tfpar.data.mesh_dataset`, `tfpar.replica_split`).

Batch 64 on `--tensor_parallel=2 --data_parallel=3` (6 logical CPUs; 22/21/21, padded to
22 with examples of weight zero, the real ones weighted 66/64) against one device with
batch 64: the MLP with Adam, 5 steps, weights within 1e-6, step losses within 1e-5
(relative), held-out loss within 1e-6. The same mesh run with the real examples weighted 1
(the padding still 0) must miss: the gradient is then 3 % short.
"""

import json
import os
import sys

import numpy as np
import pytest

from subproc import ROOT, run, run_concurrently
from test_train import max_diff

CHILD = os.path.join(ROOT, "tests", "mesh_uneven_child.py")
MLP = {"model": "mlp", "optimizer": "adam", "global_batch_size": 64, "steps": 5,
       "steps_per_epoch": 5, "verbose": 0, "validation_steps": 1}
ONE = {**MLP, "strategy": "one_device"}
MESH = {**MLP, "tensor_parallel": 2, "data_parallel": 3, "cpu_devices": 6}
# The effective batch 64 as 2 micro-steps of 32 on the mesh (each replica 11/11/10 a
# micro-step, padded to 11): the k gradients' mean must still be batch 64's.
ACCUM = {"model": "mlp", "optimizer": "momentum", "learning_rate": 0.05, "steps": 5,
         "steps_per_epoch": 5, "verbose": 0}
ONE_64 = {**ACCUM, "strategy": "one_device", "global_batch_size": 64}
MESH_ACC = {**ACCUM, "tensor_parallel": 2, "data_parallel": 3, "cpu_devices": 6,
            "global_batch_size": 32, "grad_accum_steps": 2}
ZERO3 = {**MLP, "zero_stage": 3, "data_parallel": 3, "cpu_devices": 3}


def weights(path):
    data = np.load(path)
    return [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]


def child(prefix, configs, *flags):
    out = run([sys.executable, CHILD, *flags, json.dumps(configs), prefix], timeout=360)
    return next(json.loads(line) for line in reversed(out.stdout.splitlines())
                if line.startswith("[{"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mesh_uneven")
    one, mesh, zero3, unweighted = run_concurrently([
        lambda: child(str(folder / "one"), [ONE, ONE_64]),
        lambda: child(str(folder / "mesh"), [MESH, MESH_ACC]),
        lambda: child(str(folder / "zero3"), [ZERO3]),
        lambda: child(str(folder / "unweighted"), [MESH], "--unweighted")])
    return folder, one, mesh, zero3[0], unweighted[0]


def test_batch_64_on_data_parallel_3_equals_one_device(runs, report_measured):
    folder, ones, meshes, _, unweighted = runs
    one, mesh = ones[0], meshes[0]
    assert mesh["mesh"] == {"data_parallel": 3, "tensor_parallel": 2}
    reference = weights(folder / "one.0.npz")
    diff = max_diff(reference, weights(folder / "mesh.0.npz"))
    wrong = max_diff(reference, weights(folder / "unweighted.0.npz"))
    report_measured(f"uneven batch on the mesh: 64 on tp=2 x dp=3 vs one device, mlp adam, "
                    f"5 steps: max |dw| = {diff:.1e}; real examples weighted 1: {wrong:.1e}")
    assert diff < 1e-6
    np.testing.assert_allclose(mesh["loss_history"], one["loss_history"], rtol=1e-5)
    assert abs(mesh["validation"]["loss"] - one["validation"]["loss"]) < 1e-6
    assert abs(mesh["validation"]["accuracy"] - one["validation"]["accuracy"]) < 1e-6
    assert wrong > 1e-5, wrong  # the check above would catch the unweighted split


@pytest.mark.parametrize("name,reference,run,what", [
    ("mesh", 1, 1, "tp=2 x dp=3, grad_accum_steps=2 (32 a micro-step)"),
    ("zero3", 0, 0, "ZeRO-3 on dp=3")])
def test_accumulation_and_zero3_on_an_uneven_mesh_equal_one_device(runs, name, reference,
                                                                    run, what,
                                                                    report_measured):
    folder, ones, meshes, zero3, _ = runs
    result = meshes[run] if name == "mesh" else zero3
    assert result["replicas"] == 3
    diff = max_diff(weights(folder / f"one.{reference}.npz"),
                    weights(folder / f"{name}.{run}.npz"))
    report_measured(f"uneven batch on the mesh: {what} vs one device with batch 64, 5 "
                    f"steps: max |dw| = {diff:.1e}")
    assert diff < 1e-6
    np.testing.assert_allclose(result["loss_history"], ones[reference]["loss_history"],
                               rtol=1e-5)
