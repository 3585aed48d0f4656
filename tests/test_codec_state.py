"""A gradient codec's state (error-feedback residuals, PowerSGD's Qs, its step counter)
under one set of names on every backend (`tfpar.state`'s `codec/<path>/<kind>`): a
checkpoint written by the mesh (dp2×tp2) with top-k or PowerSGD resumes on tf.distribute
(2 replicas) and the reverse, what the residuals owe the summed gradient kept (to 1e-6)
and the next steps equal to the target's uninterrupted run (SGD, to 1e-6: both backends
compute the same steps, so the writer's state at the save is the target's); onto 4
replicas what the rows owe is kept; a checkpoint in the older form (tf.distribute's
aggregator objects, `aggregator/residual_slots/<position>`, written here by a run that
forces the old writer: `tests/codec_state_child.py`) resumes on the mesh.

ZeRO 1/2's codec state under the same names: a checkpoint of ZeRO-2 with top-k or
PowerSGD (2 replicas) resumes on data parallelism with the same codec and the reverse,
the next steps and final weights equal to the target's uninterrupted run (1e-6, SGD: on
this model both backends compute the same steps); onto ZeRO-2 on 4 replicas what the rows
owe is kept, and PowerSGD continues as the 2-replica run (also from ZeRO-2 on 4 back to
data parallelism on 2); an older tfpar's ZeRO checkpoint (`zero_residual/...`) resumes,
its flat residual named in one line and not loaded.

Writers train 3 steps and save; each target loads (every other state tensor read back
equal to the saved one) and trains 3 more, compared with the target trained 6 steps from
the start (`tests/reshard_child.py`).
"""


import numpy as np

from subproc import ROOT, run_children

CHILD = f"{ROOT}/tests/codec_state_child.py"
# Width 64: every kernel is above top-k's `dense_below` and PowerSGD's rank-4 factors are
# smaller than it, so both compress (at width 32 both sent everything exactly).
SMALL = {"model_width": 64, "verbose": 0, "optimizer": "sgd", "powersgd_rank": 4}
CODECS = ("topk", "powersgd")


def _children(tmp):
    def d(name):
        return str(tmp / name)

    def run_(name, base, codec, steps, **options):
        settings = {**base, **SMALL, "compression": codec, "steps": steps}
        if "from" in options or steps == 3:
            settings["checkpoint_dir"] = d(name)
        if "from" in options:
            options = {"from": d(options["from"]), "at": 3}
        return [name, settings, options]
    mesh = {"cpu_devices": 4, "data_parallel": 2, "tensor_parallel": 2}
    dp2 = {"cpu_devices": 2, "data_parallel": 2, "strategy": "mirrored"}
    dp4 = {"cpu_devices": 4, "data_parallel": 4, "strategy": "mirrored"}
    return [
        {"cpu_devices": 4, "runs": [r for c in CODECS for r in (
            run_(f"mesh_{c}", mesh, c, 3), run_(f"ref_mesh_{c}", mesh, c, 6))]},
        {"cpu_devices": 2, "runs": [r for c in CODECS for r in (
            run_(f"ref_dp2_{c}", dp2, c, 6), run_(f"dp2_{c}", dp2, c, 3),
            run_(f"dp2_from_mesh_{c}", dp2, c, 6, **{"from": f"mesh_{c}"}))]
         + [run_("old_topk", dp2, "topk", 3)]},
        {"cpu_devices": 4, "runs": [
            *[run_(f"mesh_from_dp2_{c}", mesh, c, 6, **{"from": f"dp2_{c}"}) for c in CODECS],
            run_("mesh_from_old_topk", mesh, "topk", 6, **{"from": "old_topk"})]},
        {"cpu_devices": 4, "runs": [
            run_("dp4_from_dp2_topk", dp4, "topk", 6, **{"from": "dp2_topk"}),
            run_("dp4_from_mesh_powersgd", dp4, "powersgd", 6, **{"from": "mesh_powersgd"})]},
    ]


def _landed(out, name, rows):
    """Every tensor but the moved rows read back as saved; each residual owes what the
    saved rows owed (some of them not zero), on `rows` replicas."""
    run_ = out[name]
    assert run_["resumed_from_step"] == 3 and run_["load_diff"] == 0.0, (name, run_)
    sums = run_["residual_sums"]
    assert sums and run_["residual_rows"] == rows, (name, run_)
    for residual, (moved, largest, _) in sums.items():
        assert moved <= 1e-6, (name, residual, moved)
    assert max(largest for _, largest, _ in sums.values()) > 0, (name, sums)


def _continues(out, name, ref):
    np.testing.assert_allclose(out[name]["loss_history"], out[ref]["loss_history"][3:],
                               rtol=0, atol=1e-6, err_msg=name)


def _final_state(prefix, name, ref):
    """The resumed run's final weights equal the uninterrupted run's."""
    a, b = (dict(np.load(f"{prefix}_{n}.npz")) for n in (name, ref))
    for key in (k for k in a if k.startswith("model|")):
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-6, err_msg=f"{name} {key}")


def test_codec_state_moves_between_backends_and_replica_counts(tmp_path):
    prefix = str(tmp_path / "out")
    out, _ = run_children(CHILD, _children(tmp_path), prefix, timeout=400)
    for codec in CODECS:
        _landed(out, f"dp2_from_mesh_{codec}", 2)
        _continues(out, f"dp2_from_mesh_{codec}", f"ref_dp2_{codec}")
        _final_state(prefix, f"dp2_from_mesh_{codec}", f"ref_dp2_{codec}")
        _landed(out, f"mesh_from_dp2_{codec}", 2)
        _continues(out, f"mesh_from_dp2_{codec}", f"ref_mesh_{codec}")
        _final_state(prefix, f"mesh_from_dp2_{codec}", f"ref_mesh_{codec}")
    # The older form: read under the new names, onto the mesh.
    assert out["mesh_from_old_topk"]["old_form_names"] > 0
    assert out["dp2_from_mesh_topk"]["old_form_names"] == 0
    _landed(out, "mesh_from_old_topk", 2)
    _continues(out, "mesh_from_old_topk", "ref_mesh_topk")
    # Another replica count: what the rows owe kept. Top-k's picks depend on each row, so
    # no uninterrupted run has that state; PowerSGD's P, Q and update see the residuals only
    # through their sum, and a step's examples do not depend on the replica count, so the
    # 2-replica run continues it (the old rule, the sum alone onto 4, was 9e-6 off).
    _landed(out, "dp4_from_dp2_topk", 4)
    _landed(out, "dp4_from_mesh_powersgd", 4)
    _continues(out, "dp4_from_mesh_powersgd", "ref_dp2_powersgd")


# ZeRO 1/2's codec state under the same names: width 20 puts the 2 pieces' boundary inside
# `dense_0/bias` (1,290 entries, piece 645), a tensor top-k sends whole (at most
# `topk_dense_below`), so ZeRO-2's per-piece top-k picks what data parallelism's per-tensor
# top-k without the union picks and both runs are the same steps (measured bit-equal,
# weights and residuals, 6 steps); PowerSGD on ZeRO is data parallelism's aggregator.
ZERO_SMALL = {**SMALL, "model_width": 20, "topk_ratio": 0.1, "topk_dense_below": 100,
              "topk_union": False}


def _zero_children(tmp):
    def run_(name, base, codec, steps, source=None):
        settings = {**base, **ZERO_SMALL, "compression": codec, "steps": steps}
        if source or steps == 3:
            settings["checkpoint_dir"] = str(tmp / name)
        return [name, settings, {"from": str(tmp / source), "at": 3} if source else {}]
    dp2 = {"cpu_devices": 2, "strategy": "mirrored"}
    z2 = {**dp2, "zero_stage": 2}
    z4 = {"cpu_devices": 4, "strategy": "mirrored", "zero_stage": 2}
    return [
        {"cpu_devices": 2, "runs": [r for c in CODECS for r in (
            run_(f"z2_{c}", z2, c, 3), run_(f"ref_z2_{c}", z2, c, 6),
            run_(f"dp2_{c}", dp2, c, 3), run_(f"ref_dp2_{c}", dp2, c, 6),
            run_(f"dp2_from_z2_{c}", dp2, c, 6, f"z2_{c}"),
            run_(f"z2_from_dp2_{c}", z2, c, 6, f"dp2_{c}"))]
         # An older tfpar's ZeRO checkpoints: its aggregator as `zero_residual/...` (read),
         # its own flat residual as `zero_residual` (names nothing now: said, not loaded).
         + [run_("old_z2_powersgd", z2, "powersgd", 3),
            run_("z2_from_old_z2_powersgd", z2, "powersgd", 6, "old_z2_powersgd"),
            run_("old_z2_lowbit", z2, "lowbit", 3),
            run_("z2_from_old_z2_lowbit", z2, "lowbit", 3, "old_z2_lowbit")]},
        {"cpu_devices": 4, "runs": [
            *[run_(f"z4_from_z2_{c}", z4, c, 6, f"z2_{c}") for c in CODECS],
            run_("z4_powersgd", z4, "powersgd", 3)]},
        {"cpu_devices": 2, "runs": [
            run_("dp2_from_z4_powersgd", dp2, "powersgd", 6, "z4_powersgd")]},
    ]


def test_zero12_codec_state_moves_to_data_parallel_and_other_replica_counts(tmp_path):
    prefix = str(tmp_path / "out")
    out, stderr = run_children(CHILD, _zero_children(tmp_path), prefix)
    for codec in CODECS:
        # ZeRO-2 -> data parallelism and the reverse, 2 replicas: the next 3 steps and the
        # final weights as the target's uninterrupted run.
        for name, ref in ((f"dp2_from_z2_{codec}", f"ref_dp2_{codec}"),
                          (f"z2_from_dp2_{codec}", f"ref_z2_{codec}")):
            _landed(out, name, 2)
            _continues(out, name, ref)
            _final_state(prefix, name, ref)
        # ZeRO-2 on 2 replicas -> on 4: what the rows owe kept (each row's share summed).
        _landed(out, f"z4_from_z2_{codec}", 4)
    # PowerSGD sees the residuals only through their sum: onto 4 replicas and back from 4
    # to plain data parallelism on 2, the 2-replica run continues.
    _continues(out, "z4_from_z2_powersgd", "ref_z2_powersgd")
    _landed(out, "dp2_from_z4_powersgd", 2)
    _continues(out, "dp2_from_z4_powersgd", "ref_dp2_powersgd")
    _final_state(prefix, "dp2_from_z4_powersgd", "ref_dp2_powersgd")
    # The older form: ZeRO's aggregator read under the new names, the run continues; the
    # flat residual named in one line (it starts at zero).
    assert out["z2_from_old_z2_powersgd"]["old_form_names"] > 0
    _landed(out, "z2_from_old_z2_powersgd", 2)
    _continues(out, "z2_from_old_z2_powersgd", "ref_z2_powersgd")
    # (Said at each restore of that checkpoint: the landing's and the training's.)
    unmapped = [line.split("not loaded: ", 1)[-1] for line in stderr.splitlines()
                if "names nothing in this run" in line]
    assert unmapped and set(unmapped) == {"zero_residual/.ATTRIBUTES/per_replica"}, unmapped
    assert out["z2_from_old_z2_lowbit"]["old_form_names"] == 0
