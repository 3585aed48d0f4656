"""dp × tp × pp across worker processes: `python -m tfpar.launch --workers=2 -- python -m
tfpar.train --cpu_devices=4 --data_parallel=2 --tensor_parallel=2 --pipeline_stages=2
--microbatches=4` (each stage's mesh spans both workers, `tfpar.layout.multi_client.
stage_meshes`) against the single-device run of the same config (same seed, same data):
SGD with GPipe and Adam with 1F1B on the mlp, 5 steps, in one launched child.
"""

import json

import numpy as np

from subproc import run_concurrently
from test_layout_compose import train_configs
from test_train import max_diff, weights

STEPS = {"steps": 5, "steps_per_epoch": 5, "verbose": 0, "global_batch_size": 32,
         "model": "mlp", "microbatches": 4}
RUNS = [{"optimizer": "sgd", "learning_rate": 0.1, "schedule": "gpipe"},
        {"optimizer": "adam", "learning_rate": 1e-3, "schedule": "1f1b"}]
MESH3D = {"cpu_devices": 4, "data_parallel": 2, "tensor_parallel": 2, "pipeline_stages": 2}


def test_dp_tp_pp_across_two_workers_equals_one_device(tmp_path, report_measured):
    metrics_json = tmp_path / "metrics.json"
    configs = [{**STEPS, **r, **MESH3D} for r in RUNS]
    configs[1]["metrics_json"] = str(metrics_json)
    workers, ref = run_concurrently([
        lambda: train_configs(str(tmp_path / "3d"), configs, launch_workers=2),
        lambda: train_configs(str(tmp_path / "one"),
                              [{**STEPS, **r, "strategy": "one_device"} for r in RUNS])])
    assert sorted(workers) == [0, 1]
    one_total = sum(w.size for w in weights(str(tmp_path / "one.0")))
    worst = 0.0
    for w, results in workers.items():
        for i, (result, one) in enumerate(zip(results, ref[None])):
            assert (result["workers"], result["mesh"]) == (
                2, {"data_parallel": 2, "tensor_parallel": 2, "pipeline_stages": 2})
            diff = max_diff(weights(str(tmp_path / f"3d.{i}.worker{w}")),
                            weights(str(tmp_path / f"one.{i}")))
            assert diff < 1e-5, (w, RUNS[i], diff)
            worst = max(worst, diff)
            # Both workers read the same losses off the last stage's mesh.
            np.testing.assert_allclose(result["loss_history"], one["loss_history"], rtol=1e-5)
            assert result["loss_history"] == workers[0][i]["loss_history"]
            # This process's 4 devices: 2 per stage, one model replica of each stage.
            per_device = result["memory"]["params_per_device"]
            assert len(per_device) == 4
            assert max(per_device) < one_total / 2 and sum(per_device) >= one_total
    report_measured(f"dp=2 x tp=2 x pp=2 over 2 workers vs one device: max weight diff "
                    f"{worst:.1e} (SGD/GPipe and Adam/1F1B, 5 steps)")
    # The chief alone writes the metrics JSON.
    written = json.loads(metrics_json.read_text())
    assert (written["workers"], written["mesh"]["pipeline_stages"]) == (2, 2)
