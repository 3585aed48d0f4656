"""dp × tp × pp in one process (`tfpar.layout.pipeline`): `python -m tfpar.train
--cpu_devices=8 --data_parallel=2 --tensor_parallel=2 --pipeline_stages=2 --microbatches=4`
against the single-device run of the same config (same seed, same data): SGD and Adam on
the mlp and the transformer; GPipe, 1F1B, interleaved (V=2) and ZB-H1; gradient
accumulation (k=2) and bf16. All 3D runs share one child (one set of meshes per process),
the references another.
"""

import math

import numpy as np

from subproc import run_concurrently
from test_layout_compose import train_configs
from test_train import max_diff, weights

STEPS = {"steps": 5, "steps_per_epoch": 5, "verbose": 0, "global_batch_size": 32}
SGD = {"optimizer": "sgd", "learning_rate": 0.1}
ADAM = {"optimizer": "adam", "learning_rate": 1e-3}
# (run, weight tolerance). bf16: the tolerance of tests/test_layout_compose.py's tp=2 bf16
# case (the mesh sums partial products in bf16 where one device rounds once).
RUNS = [({"model": "mlp", **SGD, "schedule": "gpipe"}, 1e-5),
        ({"model": "mlp", **ADAM, "schedule": "1f1b"}, 1e-5),
        ({"model": "transformer", **SGD, "schedule": "1f1b"}, 1e-5),
        ({"model": "mlp", **ADAM, "schedule": "1f1b", "grad_accum_steps": 2}, 1e-5),
        ({"model": "mlp", **SGD, "schedule": "1f1b", "mixed_precision": "bf16"}, 1e-2),
        ({"model": "mlp", **SGD, "schedule": "interleaved", "virtual_stages": 2,
          "model_depth": 3}, 1e-5),
        ({"model": "mlp", **ADAM, "schedule": "zb_h1"}, 1e-5),
        # Adam on the transformer: the reference's optimizer gets the embedding's gradient
        # dense, as the mesh's is (tests/train_configs_child.py); the stock one-device
        # trainer hands Adam `IndexedSlices`, which Keras squares slice by slice (see
        # tests/test_layout_exact.py).
        ({"model": "transformer", **ADAM, "schedule": "gpipe", "dense_gradients": True},
         1e-5)]
MESH3D = {"cpu_devices": 8, "data_parallel": 2, "tensor_parallel": 2, "pipeline_stages": 2,
          "microbatches": 4}


def _case(run):
    """A short name for the measured line."""
    extra = [k for k in ("grad_accum_steps", "mixed_precision") if k in run]
    return "/".join([run["model"], run["optimizer"], run["schedule"]]
                    + [f"{k}={run[k]}" for k in extra])


def test_dp_tp_pp_equals_one_device(tmp_path, report_measured):
    runs = [r for r, _ in RUNS]
    three_d, ref = run_concurrently([
        lambda: train_configs(str(tmp_path / "3d"), [
            {**STEPS, **{k: v for k, v in r.items() if k != "dense_gradients"}, **MESH3D}
            for r in runs]),
        lambda: train_configs(str(tmp_path / "one"),
                              [{**STEPS, **r, "strategy": "one_device"} for r in runs])])
    measured = []
    for i, ((run, tol), result, one) in enumerate(zip(RUNS, three_d[None], ref[None])):
        assert result["strategy"] == "DTensorMesh"
        assert result["mesh"] == {"data_parallel": 2, "tensor_parallel": 2,
                                  "pipeline_stages": 2}
        diff = max_diff(weights(str(tmp_path / f"3d.{i}")), weights(str(tmp_path / f"one.{i}")))
        assert diff < tol, (run, diff)
        measured.append(f"{_case(run)} {diff:.1e}")
        np.testing.assert_allclose(result["loss_history"], one["loss_history"],
                                   rtol=1e-5 if tol < 1e-3 else 5e-3)
        # Each of the 8 devices holds one stage's shard: less than a whole tp=2 mesh
        # (one stage per device group) would hold, and the shards add up to the model.
        per_device = result["memory"]["params_per_device"]
        total = sum(np.load(str(tmp_path / f"one.{i}.npz"))[k].size
                    for k in np.load(str(tmp_path / f"one.{i}.npz")).files)
        assert len(per_device) == 8
        assert max(per_device) < total / 2, (per_device, total)
        assert sum(per_device) / 2 >= total  # per batch row: every parameter at least once
    report_measured("dp=2 x tp=2 x pp=2 vs one device after 5 steps, max weight diff: "
                    + ", ".join(measured))
    assert math.isfinite(three_d[None][-1]["final_loss"])
