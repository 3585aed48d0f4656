"""`python -m tfpar.train --tensor_parallel=2` with mixed precision and gradient
accumulation: the trainer's DTensor backend against the single-device run of the same
config (same seed, same data). The single-device runs share one child, the tp=2 runs
another (the two at once).

Measured on the mesh step itself (tests/test_layout_keras.py): accumulation within 3.3e-7
of the k x batch step; bf16 within 5.1e-3 of single-device bf16 after 5 steps, since the
mesh sums partial products in bf16 where one device rounds once. fp16 keeps Keras's own
loss scaling, its skip decision taken once for the whole mesh.
"""

import json
import os
import sys

import numpy as np
import pytest

from subproc import ROOT, run, run_concurrently
from test_train import max_diff, weights

TP = {"tensor_parallel": 2, "data_parallel": 1, "cpu_devices": 2}
CONFIGS_CHILD = os.path.join(ROOT, "tests", "train_configs_child.py")
STEPS = {"steps": 5, "steps_per_epoch": 5, "verbose": 0, "global_batch_size": 32,
         "model": "mlp"}
OPTIMIZERS = [{"optimizer": "sgd", "learning_rate": 0.1},
              {"optimizer": "adam", "learning_rate": 1e-3}]
PRECISION = [({"grad_accum_steps": 2, "optimizer": "adam"}, 1e-5),
             ({"mixed_precision": "bf16", "optimizer": "sgd", "learning_rate": 0.1}, 1e-2),
             ({"mixed_precision": "fp16", "optimizer": "sgd", "learning_rate": 0.1}, 1e-2)]


def train_configs(prefix, configs, launch_workers=0, env=None):
    cmd = [sys.executable, CONFIGS_CHILD, json.dumps(configs), prefix]
    if launch_workers:
        cmd = [sys.executable, "-m", "tfpar.launch", f"--workers={launch_workers}",
               "--timeout=300", "--"] + cmd
    out = run(cmd, timeout=360, env=env)
    if not launch_workers:  # the child prints one JSON list
        return {None: next(json.loads(line) for line in reversed(out.stdout.splitlines())
                           if line.startswith("[{"))}
    return {int(line[len("[worker "):line.index("]")]): json.loads(line.split("] ", 1)[1])
            for line in out.stdout.splitlines()
            if line.startswith("[worker ") and "] [{" in line}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two children at once: the single-device runs (PRECISION's, then OPTIMIZERS' for the
    two-worker test) and the tp=2 runs of PRECISION, each child's runs on its one runtime.
    `(folder, one-device results, tp results)`; run i's weights are `one.i` / `tp.i`."""
    folder = tmp_path_factory.mktemp("compose")
    configs = [{**STEPS, **settings} for settings, _ in PRECISION]
    one, tp = run_concurrently([
        lambda: train_configs(str(folder / "one"), [
            {**c, "strategy": "one_device"} for c in configs + [{**STEPS, **o}
                                                               for o in OPTIMIZERS]]),
        lambda: train_configs(str(folder / "tp"), [{**c, **TP} for c in configs])])
    return folder, one[None], tp[None]


@pytest.mark.parametrize("i", range(len(PRECISION)),
                         ids=["accumulation", "bf16", "fp16"])
def test_tensor_parallel_trainer_equals_one_device(runs, i):
    folder, one, tp = runs
    tol = PRECISION[i][1]
    assert tp[i]["strategy"] == "DTensorMesh"
    assert max_diff(weights(str(folder / f"tp.{i}")), weights(str(folder / f"one.{i}"))) < tol
    np.testing.assert_allclose(tp[i]["loss_history"], one[i]["loss_history"],
                               rtol=1e-5 if tol < 1e-3 else 5e-3)


def test_trainer_tensor_parallel_across_two_workers_equals_one_device(tmp_path, runs,
                                                                      report_measured):
    # python -m tfpar.launch --workers=2 -- python -m tfpar.train --tensor_parallel=2
    # --data_parallel=2 --cpu_devices=2: each worker derives its DTensor client settings
    # from TF_CONFIG; batch=2 across the processes × model=2 inside each.
    ckpt, metrics_json = tmp_path / "ckpt", tmp_path / "metrics.json"
    folder, one, _ = runs
    ref = one[len(PRECISION):]  # OPTIMIZERS' single-device runs
    tp_configs = [{**STEPS, **o, "tensor_parallel": 2, "data_parallel": 2, "cpu_devices": 2}
                  for o in OPTIMIZERS]
    tp_configs[1].update(checkpoint_dir=str(ckpt), metrics_json=str(metrics_json))
    workers = train_configs(str(tmp_path / "tp"), tp_configs, launch_workers=2)
    assert sorted(workers) == [0, 1]
    worst = 0.0
    for w, results in workers.items():
        for i, (result, ref_i) in enumerate(zip(results, ref, strict=True)):
            assert (result["workers"], result["mesh"]) == (
                2, {"data_parallel": 2, "tensor_parallel": 2})
            diff = max_diff(weights(str(tmp_path / f"tp.{i}.worker{w}")),
                            weights(str(folder / f"one.{len(PRECISION) + i}")))
            assert diff < 1e-5, (w, OPTIMIZERS[i], diff)
            worst = max(worst, diff)
            np.testing.assert_allclose(result["loss_history"], ref_i["loss_history"],
                                       rtol=1e-5)
    report_measured(f"tp=2 x dp=2 over 2 workers vs one device: max weight diff {worst:.1e} "
                    "(SGD and Adam, 5 steps)")
    # The chief alone writes the metrics JSON and the checkpoint (a worker's scratch copy
    # is removed); the chief's checkpoint holds the trained weights.
    assert json.loads(metrics_json.read_text())["workers"] == 2
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".worker")) == []
    assert any(p.name.startswith("ckpt-5") for p in ckpt.iterdir())


def test_compression_on_the_mesh_takes_the_batch_axis_codecs_and_refuses_the_rest():
    # tfpar.layout.reduction compresses the batch axis's reduction with fp16, bf16, int8,
    # lowbit, topk, threshold, powersgd (tests/test_layout_mesh.py trains them) and auto
    # (tfpar.layout.auto, tests/test_mesh_auto.py).
    from tfpar.config import ParallelConfig
    from tfpar.errors import ConfigError
    for codec in ("fp16", "bf16", "int8", "lowbit", "topk", "threshold", "powersgd", "auto"):
        ParallelConfig(tensor_parallel=2, data_parallel=2, cpu_devices=4, compression=codec)
    # One replica on `batch` (given, or what --cpu_devices leaves): nothing to compress.
    for settings in ({"data_parallel": 1}, {"cpu_devices": 2}):
        with pytest.raises(ConfigError, match="compression='int8'.*--data_parallel>1 or "
                                              "--compression=none"):
            ParallelConfig(tensor_parallel=2, compression="int8", **settings)
    # What the mesh's codecs do not build: refused, not ignored.
    for codec, settings in (("powersgd", {"powersgd_start_step": 10}),
                            ("topk", {"topk_warmup_steps": 10})):
        setting = next(iter(settings))
        with pytest.raises(ConfigError, match=f"{setting}=10.*DTensor mesh.*{setting}=0"):
            ParallelConfig(tensor_parallel=2, data_parallel=2, cpu_devices=4,
                           compression=codec, **settings)
