"""A gradient codec's state (error-feedback residuals, PowerSGD's Qs, its step counter)
under one set of names on every backend (`tfpar.state`'s `codec/<path>/<kind>`): a
checkpoint written by the mesh (dp2×tp2) with top-k or PowerSGD resumes on tf.distribute
(2 replicas) and the reverse, what the residuals owe the summed gradient kept (to 1e-6)
and the next steps equal to the target's uninterrupted run (SGD, to 1e-6: both backends
compute the same steps, so the writer's state at the save is the target's); onto 4
replicas what the rows owe is kept; a checkpoint in the older form (tf.distribute's
aggregator objects, `aggregator/residual_slots/<position>`, written here by a run that
forces the old writer: `tests/codec_state_child.py`) resumes on the mesh.

Writers train 3 steps and save; each target loads (every other state tensor read back
equal to the saved one) and trains 3 more, compared with the target trained 6 steps from
the start (`tests/reshard_child.py`).
"""

import json
import sys

import numpy as np

from subproc import ROOT, last_json_line, run

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
    out = {}
    for child in _children(tmp_path):
        out.update(last_json_line(run([sys.executable, CHILD, json.dumps(child), prefix],
                                      timeout=400).stdout))
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
