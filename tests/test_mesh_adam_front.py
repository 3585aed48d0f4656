"""Adam in front of the mesh's codecs (`tfpar.layout.adam_front`) on dp2×tp2 (mlp), against
the uncompressed mesh run and tf.distribute's Adam in front (2 replicas) on the same seed
and data:

- during the exact warm-up the weights equal the uncompressed mesh run's (1e-6);
- PowerSGD at rank 32 (the 256×256 kernel compressed, the others whole) with `v` each
  replica's own (the default) equals tf.distribute's run after the warm-up too: weights,
  Adam's moments and counter to 1e-5, the residuals to 1e-4 (of ~7): the two backends
  compute one method (`tfpar.compression.adam_front`'s functions);
- with fp16 loss scaling (PowerSGD) and `--grad_accum_steps=2` (top-k at ratio 1) the codec
  runs once a step and the backends end closer to each other than fp16 (or accumulation)
  moves a run (not 1e-5: the assertions say why); an overflowing fp16 step (one infinite
  input on one replica) is skipped by the whole mesh and leaves residuals, moments and
  counter as they were;
- lowbit's bytes are ~0.1× fp32's and its steps past the warm-up compressed (its counter);
  a warm-up step is one fp32 mean over `batch` (each replica keeping its own `v`, the
  moments are moved whole, then written to rows): a run that ends in the warm-up reports
  fp32's bytes, and a warm-up step runs the collectives of one with `v` frozen (moments
  whole), counted under TensorFlow's profiler, also after a save in the warm-up; past the
  warm-up a compressed step reads and writes no warm-up copy of the moments (its
  variable reads and writes, by the profiler, are those of a run that keeps none, but
  the flag that says whether the copies are trusted);
- a checkpoint of top-k at its defaults (width 64: every kernel compressed, residuals
  held) with Adam in front written on the mesh resumes on tf.distribute and the reverse:
  every tensor read back as saved, Adam's moments and the counter loaded (not "no place"),
  and the next 3 losses and the final weights equal the target's uninterrupted run (1e-5).

Five children, two at a time: the mesh's and tf.distribute's runs and the mesh steps
(the warm-up's collectives, the fp16 skip), then the two resumes.
The runs' children run with grappler off (tests/graph_optimizer.py), both backends
alike; the mesh steps whose collectives and variable ops the profiler counts with it on.
"""

import json
import sys

import numpy as np

from graph_optimizer import OFF as GRAPPLER_OFF
from subproc import ROOT, last_json_line, run, run_concurrently

CHILD = f"{ROOT}/tests/mesh_adam_front_child.py"
ADAM = {"verbose": 0, "optimizer": "adam", "adam_warmup_steps": 2}
MESH = {"cpu_devices": 4, "data_parallel": 2, "tensor_parallel": 2}
DP2 = {"cpu_devices": 2, "data_parallel": 2, "strategy": "mirrored"}
WIDE = {"model_width": 64}  # top-k compresses every kernel (codec_state's width)


def _run(name, layout, steps, tmp, **settings):
    settings = {**ADAM, **layout, "steps": steps, **settings}
    options = {}
    if "resume_from" in settings:
        options = {"from": str(tmp / settings.pop("resume_from")), "at": 3}
    if options or name.endswith("_ckpt"):
        settings["checkpoint_dir"] = str(tmp / name)
    return [name, settings, options]


def _child(tmp, prefix, cpu_devices, runs):
    out = run([sys.executable, CHILD, json.dumps({"cpu_devices": cpu_devices, "runs": runs}),
               prefix], timeout=600, env=GRAPPLER_OFF).stdout
    results = json.loads(next(line for line in reversed(out.splitlines())
                              if line.startswith('{"') and not line.startswith('{"comm"')))
    assert {r["grappler"] for r in results.values()} == {"off"}, results  # as asked
    comms = last_json_line(out)["comm"]
    for (name, _, _), comm in zip(runs, comms):
        results[name]["comm"] = comm
    return results


def _state(prefix, name):
    return dict(np.load(f"{prefix}_{name}.npz"))


def _diff(prefix, a, b, start="model|", end="", scale=1.0):
    """The largest difference of run `a`'s state tensors named `start…end` from `scale`×
    run `b`'s."""
    x, y = _state(prefix, a), _state(prefix, b)
    keys = [k for k in x if k.startswith(start) and k.endswith(end)]
    assert keys and all(k in y for k in keys), (a, b, keys)
    return max(float(np.max(np.abs(x[k] - scale * y[k]))) for k in keys)


def test_mesh_adam_front(tmp_path):
    prefix = str(tmp_path / "out")
    mesh_runs = [
        _run("mesh_none", MESH, 3, tmp_path),
        _run("mesh_topk_warm", MESH, 3, tmp_path, compression="topk", adam_warmup_steps=5),
        _run("mesh_powersgd", MESH, 5, tmp_path, compression="powersgd", powersgd_rank=32),
        _run("mesh_lowbit", MESH, 4, tmp_path, compression="lowbit"),
        _run("mesh_powersgd_fp16", MESH, 5, tmp_path, compression="powersgd",
             powersgd_rank=32, mixed_precision="fp16"),
        _run("mesh_topk_accum", MESH, 5, tmp_path, compression="topk", topk_ratio=1.0,
             grad_accum_steps=2),
        _run("mesh_topk_ckpt", MESH, 3, tmp_path, compression="topk", **WIDE),
        _run("ref_mesh_topk", MESH, 6, tmp_path, compression="topk", **WIDE),
        _run("mesh_topk_frozen", MESH, 5, tmp_path, compression="topk", topk_ratio=0.05,
             **WIDE)]
    dp2_runs = [
        _run("dp2_powersgd", DP2, 5, tmp_path, compression="powersgd", powersgd_rank=32),
        _run("dp2_powersgd_fp16", DP2, 5, tmp_path, compression="powersgd",
             powersgd_rank=32, mixed_precision="fp16"),
        _run("dp2_topk_accum", DP2, 5, tmp_path, compression="topk", topk_ratio=1.0,
             grad_accum_steps=2),
        _run("dp2_topk_ckpt", DP2, 3, tmp_path, compression="topk", **WIDE),
        _run("ref_dp2_topk", DP2, 6, tmp_path, compression="topk", **WIDE),
        _run("dp2_topk_frozen", DP2, 5, tmp_path, compression="topk", topk_ratio=0.05,
             **WIDE)]
    out = {}
    for part in run_concurrently([
            lambda: _child(tmp_path, prefix, 4, mesh_runs),
            lambda: _child(tmp_path, prefix, 2, dp2_runs),
            lambda: last_json_line(run([sys.executable, CHILD, "mesh_steps"],
                                       timeout=600).stdout)]):
        out.update(part)
    resumes = [
        [_run("dp2_from_mesh", DP2, 6, tmp_path, compression="topk",
              resume_from="mesh_topk_ckpt", **WIDE)],
        [_run("mesh_from_dp2", MESH, 6, tmp_path, compression="topk",
              resume_from="dp2_topk_ckpt", **WIDE)]]
    for part in run_concurrently([lambda: _child(tmp_path, prefix, 2, resumes[0]),
                                  lambda: _child(tmp_path, prefix, 4, resumes[1])]):
        out.update(part)

    # The warm-up is exact Adam on the fp32 mean.
    assert _diff(prefix, "mesh_topk_warm", "mesh_none") < 1e-6
    # One method on both backends: after 2 exact and 3 compressed steps.
    moved = _diff(prefix, "mesh_powersgd", "mesh_none")
    assert moved > 1e-3, moved  # it trained (2 more steps than the uncompressed run)
    assert _diff(prefix, "mesh_powersgd", "dp2_powersgd") < 1e-5
    # Top-k compressed, both of its variants of `v`: at its default ratio (each replica's
    # own, the momentum synced) and below 0.1 (`v` frozen after the warm-up, then raised),
    # 4 and 3 steps past the warm-up, every kernel compressed (the review measured 4.5e-8
    # and 6.0e-8 apart).
    for mesh_run, dp2_run in (("ref_mesh_topk", "ref_dp2_topk"),
                              ("mesh_topk_frozen", "dp2_topk_frozen")):
        assert _diff(prefix, mesh_run, "mesh_topk_ckpt") > 1e-3, mesh_run  # past step 3
        assert _diff(prefix, mesh_run, dp2_run) < 1e-5, mesh_run
    # Its state too: Adam's moments and counter as they are; a mesh's residual row is its
    # replica's own error, tf.distribute's its share (a half); PowerSGD's Q (only its span
    # matters) is summed in those units, so it is not compared.
    for kind in ("adam_m", "adam_v", "step"):
        assert _diff(prefix, "mesh_powersgd", "dp2_powersgd", "codec|", kind) < 1e-5, kind
    kernel = "codec|dense_1|kernel|"
    residual = _diff(prefix, "mesh_powersgd", "dp2_powersgd", kernel, "residual")
    assert _diff(prefix, "mesh_powersgd", "dp2_powersgd", kernel, "residual",
                 2.0) < 1e-4 < residual
    # fp16 loss scaling and accumulation: the codec once a step (its counter), and the
    # backends closer to each other than fp16 moves a run from fp32, or accumulation from
    # one batch. Not to 1e-5: the mesh's fp16 matmuls are split over `model` (other
    # roundings, which Adam's normalisation enlarges: 1.7e-3 apart, measured), and the
    # backends cut a step's batch into replicas and micro-batches in another order, so each
    # replica's own `v` sees other examples (2.8e-3 apart).
    for name, other in (("powersgd_fp16", "mesh_powersgd"), ("topk_accum", "mesh_none")):
        for backend in ("mesh", "dp2"):
            counters = [v for k, v in _state(prefix, f"{backend}_{name}").items()
                        if k.endswith("|step")]
            assert counters == [5], (backend, name, counters)
        apart = _diff(prefix, f"mesh_{name}", f"dp2_{name}")
        assert apart < 0.5 * _diff(prefix, f"mesh_{name}", other), (name, apart)
    # An overflowing fp16 step is skipped by the whole mesh and leaves the codec's state
    # (residuals, Adam's moments, its counter) as it was; the next step moves it again.
    skip = out["fp16_skip"]
    assert skip["reduction"] == "AdamFrontReduction", skip
    assert skip["tensors_nonzero"] > 0 and skip["counters"] == [2.0], skip
    assert skip["state_moved"] == 0.0 and skip["weights_moved"] == 0.0, skip
    assert skip["scales"][1] == skip["scales"][0] / 2, skip
    assert skip["tensors_moved_next"] > 0 and skip["weights_moved_next"] > 0, skip
    assert all(np.isfinite(skip["losses"])), skip
    # lowbit's bytes, and its two steps past the warm-up counted.
    ratio = out["mesh_lowbit"]["comm"]["compression_ratio"]
    assert 8 < ratio < 12, out["mesh_lowbit"]["comm"]
    counters = {k: v for k, v in _state(prefix, "mesh_lowbit").items()
                if k.startswith("codec|") and k.endswith("|step")}
    assert list(counters.values()) == [4], counters
    assert out["mesh_topk_ckpt"]["comm"]["compression_ratio"] > 1.2
    # A run that ended in the warm-up counts its last step's bytes: fp32's, once (each
    # replica keeps its own `v`: the moments move whole, no second mean of rows).
    assert out["mesh_topk_warm"]["comm"]["compression_ratio"] == 1.0, out["mesh_topk_warm"]
    # A warm-up step with each replica's own `v` (rows) runs the collectives of one with `v`
    # frozen (whole): no second mean (before, 60 all-reduce events against 36, 2026-12-05).
    warm = out["warm_collectives"]
    assert warm["own_v"]["rows"] == [False, True] and warm["frozen_v"]["rows"] == [False] * 2
    assert warm["frozen_v"]["collectives"].get("CollectiveReduceV2", 0) > 0, warm
    assert warm["own_v"]["collectives"] == warm["frozen_v"]["collectives"], warm
    assert warm["own_v"]["comm"]["compression_ratio"] == 1.0, warm
    # A save in the warm-up leaves the whole copies trusted: the next warm-up step runs
    # the same collectives (before, a save cleared them: a second fp32 mean, counted
    # nowhere).
    for variant in ("own_v", "frozen_v"):
        assert warm[variant]["collectives_after_save"] == warm["frozen_v"]["collectives"], warm
    # After the warm-up a compressed step reads and writes no whole copy: per device, rows
    # with copies write the variables `v` frozen writes and read one more, `warm_ok` (a
    # scalar; unused with `v` frozen, its read pruned). Before, every copy was read and
    # written back too: 7 reads and 6 writes more per device (2026-12-06).
    assert warm["own_v"]["copies"] == 6 and warm["frozen_v"]["copies"] == 0, warm
    ops = {v: warm[v]["variable_ops"] for v in ("own_v", "frozen_v")}
    more = {k: (ops["own_v"][k] - ops["frozen_v"][k]) / 4  # 4 devices
            for k in ("ReadVariableOp", "AssignVariableOp")}
    assert ops["frozen_v"]["ReadVariableOp"] > 0, ops
    assert more == {"ReadVariableOp": 1, "AssignVariableOp": 0}, (more, ops)

    # Top-k's checkpoint both ways: every tensor as saved, the moments among them.
    for name, ref in (("dp2_from_mesh", "ref_dp2_topk"), ("mesh_from_dp2", "ref_mesh_topk")):
        landed = out[name]
        assert landed["resumed_from_step"] == 3 and landed["load_diff"] == 0.0, landed
        assert max(largest for _, largest, _ in landed["residual_sums"].values()) > 0
        saved = _state(prefix, name)
        assert any(k.endswith("|adam_v") and v.any() for k, v in saved.items()), name
        np.testing.assert_allclose(landed["loss_history"], out[ref]["loss_history"][3:],
                                   rtol=0, atol=1e-5, err_msg=name)
        assert _diff(prefix, name, ref) < 1e-5, name
