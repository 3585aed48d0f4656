"""dp × tp × pp in one process (`tfpar.layout.pipeline`): `python -m tfpar.train
--cpu_devices=8 --data_parallel=2 --tensor_parallel=2 --pipeline_stages=2 --microbatches=4`
against the single-device run of the same config (same seed, same data): SGD and Adam on
the mlp, Adam on the transformer; GPipe, 1F1B, interleaved (V=2) and ZB-H1; gradient
accumulation (k=2), bf16, fp16 (one loss scale; an infinite gradient on one stage skips
every stage's update: tests/test_mesh_codec_compose.py, with int8 on each stage's reduction
too, its residuals kept), compression (fp16, int8; bf16 is fp16's code with another dtype, run
on the 2×2 mesh by tests/test_layout_mesh.py) on each stage's batch-axis reduction, each
checked to have run, and recompute (the transformer). All 3D runs share one child
(one set of meshes per process), the references another. Each run costs its trace (12-36 s
under load, 2026-12-05), not its 5 steps (20-70 ms each): runs, not steps, are the time.
"""

import numpy as np

from subproc import run_concurrently
from test_layout_compose import train_configs
from test_train import max_diff, weights

STEPS = {"steps": 5, "steps_per_epoch": 5, "verbose": 0, "global_batch_size": 32}
SGD = {"optimizer": "sgd", "learning_rate": 0.1}
ADAM = {"optimizer": "adam", "learning_rate": 1e-3}
# (run, weight tolerance). bf16: the tolerance of tests/test_layout_compose.py's tp=2 bf16
# case (the mesh sums partial products in bf16 where one device rounds once).
# (An mlp GPipe SGD run with recompute was dropped: GPipe and recompute run on the
# transformer below, SGD exactly with the interleaved schedule.)
RUNS = [  # 1F1B with Adam runs here with accumulation (k=2): one run fewer than with and
        # without it, and accumulation's loop contains the plain step.
        ({"model": "mlp", **ADAM, "schedule": "1f1b", "grad_accum_steps": 2}, 1e-5),
        ({"model": "mlp", **SGD, "schedule": "1f1b", "mixed_precision": "bf16"}, 1e-2),
        ({"model": "mlp", **SGD, "schedule": "interleaved", "virtual_stages": 2,
          "model_depth": 3}, 1e-5),
        ({"model": "mlp", **ADAM, "schedule": "zb_h1"}, 1e-5),
        # Adam on the transformer: the reference's optimizer gets the embedding's gradient
        # dense, as the mesh's is (tests/train_configs_child.py); the stock one-device
        # trainer hands Adam `IndexedSlices`, which Keras squares slice by slice (see
        # tests/test_layout_exact.py).
        # Recompute on it too: each stage's forward wrapped in `tf.recompute_grad`, the same
        # ops again, as exact as without.
        ({"model": "transformer", **ADAM, "schedule": "gpipe", "dense_gradients": True,
          "recompute": "full"}, 1e-5),
        # Each replica's gradient summed over `batch` in fp16 (tfpar.layout.reduction),
        # which one device does not round: 2^-11 of a gradient of up to ~2, × lr 0.1 ×
        # 5 steps ≈ 5e-4 at most (measured 9.6e-5; 1.6e-5 without accumulation).
        ({"model": "mlp", **SGD, "schedule": "1f1b", "compression": "fp16",
          "grad_accum_steps": 2}, 5e-4),
        # int8 (one scale per 256 entries, error feedback on): with SGD the weights trail
        # the exact ones by lr × the residual still held back, under half a quantisation
        # step of each replica's gradient: lr 0.1 × 2 replicas × ~2/254 ≈ 1.6e-3 at most.
        ({"model": "mlp", **SGD, "schedule": "1f1b", "compression": "int8"}, 2e-3),
        # fp16: the tolerance of the tp=2 fp16 case (tests/test_layout_compose.py).
        ({"model": "mlp", **SGD, "schedule": "1f1b", "mixed_precision": "fp16"}, 1e-2)]
# A codec's weights are further than this from one device's (an uncompressed mesh run's
# summation order stays below it).
CODEC_RAN = 1e-5
MESH3D = {"cpu_devices": 8, "data_parallel": 2, "tensor_parallel": 2, "pipeline_stages": 2,
          "microbatches": 4}


def _case(run):
    """A short name for the measured line."""
    extra = [k for k in ("grad_accum_steps", "mixed_precision", "compression", "recompute")
             if k in run]
    return "/".join([run["model"], run["optimizer"], run["schedule"]]
                    + [f"{k}={run[k]}" for k in extra])


def test_dp_tp_pp_equals_one_device(tmp_path, report_measured):
    runs = [r for r, _ in RUNS]
    three_d, ref = run_concurrently([
        lambda: train_configs(str(tmp_path / "3d"), [
            {**STEPS, **{k: v for k, v in r.items() if k != "dense_gradients"}, **MESH3D}
            for r in runs]),
        lambda: train_configs(str(tmp_path / "one"), [
            {**STEPS, **{k: v for k, v in r.items() if k != "compression"},
             "strategy": "one_device"} for r in runs])])
    three_d, ref = three_d[None], ref[None]
    prefix = [str(tmp_path / f"3d.{i}") for i in range(len(three_d))]
    measured = []
    for i, ((run, tol), result, one) in enumerate(zip(RUNS, three_d, ref)):
        assert result["strategy"] == "DTensorMesh"
        assert result["mesh"] == {"data_parallel": 2, "tensor_parallel": 2,
                                  "pipeline_stages": 2}
        diff = max_diff(weights(prefix[i]), weights(str(tmp_path / f"one.{i}")))
        assert diff < tol, (run, diff)
        measured.append(f"{_case(run)} {diff:.1e}")
        np.testing.assert_allclose(result["loss_history"], one["loss_history"],
                                   rtol=min(5e-3, max(1e-5, tol)))
        if "compression" in run:
            # The codec ran: further from one device than the uncompressed mesh's
            # summation order puts it (the runs above, within 1e-5; measured ≤ 2.7e-6).
            assert diff > CODEC_RAN, (run, diff)
        # Each of the 8 devices holds one stage's shard: less than a whole tp=2 mesh
        # (one stage per device group) would hold, and the shards add up to the model.
        per_device = result["memory"]["params_per_device"]
        total = sum(np.load(str(tmp_path / f"one.{i}.npz"))[k].size
                    for k in np.load(str(tmp_path / f"one.{i}.npz")).files)
        assert len(per_device) == 8
        assert max(per_device) < total / 2, (per_device, total)
        assert sum(per_device) / 2 >= total  # per batch row: every parameter at least once
        if run.get("mixed_precision") == "fp16":  # one scale, taken by both stages
            assert len(set(result["loss_scales"])) == 1, result["loss_scales"]
    report_measured("dp=2 x tp=2 x pp=2 vs one device after 5 steps, max weight diff: "
                    + ", ".join(measured))
