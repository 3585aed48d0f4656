"""State that moves between optimizers' and codecs' forms on load (`tfpar.state`), each
resumed run against the target's uninterrupted run from the same state (the next steps'
losses and the final weights: 1e-6 SGD, 1e-5 Adam; `tests/reshard_child.py`):

- ZeRO-2 (2 replicas) ⇄ the dp2×tp2 mesh, Adam behind PowerSGD: optimizer slots, the
  residuals and PowerSGD's Qs under one set of names, each landing in the target's layout;
- ZeRO-2's sharded Adam slots written on 4 replicas re-cut for 2, and from 2 for 4;
- one replica loading 2 replicas' error-feedback residuals (data parallel, ZeRO-2): the
  debt, their sum, paid once on the next step (against the same checkpoint resumed
  without the codec: the weights differ by exactly `-lr × debt`, the residual then 0);
- Adam in front of PowerSGD (in its exact warm-up, where its moments are Keras's) resumed
  with Adam behind the codec and with no codec; Keras's Adam resumed with Adam in front.
"""

import json
import sys

import numpy as np

from subproc import ROOT, last_json_line, run

CHILD = f"{ROOT}/tests/reshard_child.py"
# Width 64: PowerSGD's rank-4 factors are smaller than every kernel (it compresses).
ADAM = {"model_width": 64, "verbose": 0, "powersgd_rank": 4}
# Adam behind PowerSGD: the mesh's (tf.distribute's `--compress_adam_step` default puts it
# in front) and ZeRO 1/2's (always behind).
BEHIND = {**ADAM, "compression": "powersgd", "compress_adam_step": False}
# Top-k at width 64 drops entries of every kernel: SGD's debt, lr 0.05 (a debt × lr
# far above float32's rounding of the weights).
TOPK = {"model_width": 64, "verbose": 0, "optimizer": "sgd", "learning_rate": 0.05,
        "compression": "topk"}
PSGD_SGD = {**TOPK, "compression": "powersgd", "powersgd_rank": 4}
# Adam in front of PowerSGD in its exact warm-up (50 steps by default): the same steps as
# Keras's Adam; and behind PowerSGD before it starts compressing, the same again.
FRONT = {**ADAM, "compression": "powersgd"}
LATE = {**BEHIND, "powersgd_start_step": 100}
KERAS = {**ADAM, "compression": "none"}


def _children(tmp):
    def d(name):
        return str(tmp / name)

    def write(name, settings, steps):
        return [name, {**settings, "steps": steps, "checkpoint_dir": d(name)}, {}]

    def ref(name, settings, steps):
        return [name, {**settings, "steps": steps}, {}]

    def resume(name, settings, steps, source, at, **options):
        return [name, {**settings, "steps": steps, "checkpoint_dir": d(name)},
                {"from": d(source), "at": at, **options}]
    mesh = {"cpu_devices": 4, "data_parallel": 2, "tensor_parallel": 2}
    z2 = {"cpu_devices": 2, "data_parallel": 2, "strategy": "mirrored", "zero_stage": 2}
    z4 = {**z2, "cpu_devices": 4, "data_parallel": 4}
    dp2 = {"cpu_devices": 2, "data_parallel": 2, "strategy": "mirrored"}
    one = {"cpu_devices": 2, "data_parallel": 1, "strategy": "one_device"}
    z1rep = {**z2, "data_parallel": 1}
    return [
        {"cpu_devices": 4, "runs": [write("mesh_psgd", {**mesh, **BEHIND}, 3),
                                    ref("ref_mesh_psgd", {**mesh, **BEHIND}, 6)]},
        {"cpu_devices": 4, "runs": [write("z4", {**z4, **ADAM}, 2),
                                    ref("ref_z4", {**z4, **ADAM}, 4)]},
        {"cpu_devices": 2, "runs": [
            # ZeRO ⇄ mesh
            write("z2_psgd", {**z2, **BEHIND}, 3), ref("ref_z2_psgd", {**z2, **BEHIND}, 6),
            resume("z2_from_mesh_psgd", {**z2, **BEHIND}, 6, "mesh_psgd", 3),
            # ZeRO-2's slots re-cut: 4 -> 2 (and the writer for 2 -> 4)
            ref("ref_z2", {**z2, **ADAM}, 4), resume("z2_from_z4", {**z2, **ADAM}, 4, "z4", 2),
            write("z2", {**z2, **ADAM}, 2),
            # One replica owes 2 replicas' debt
            write("dp2_topk", {**dp2, **TOPK}, 3), write("z2_topk", {**z2, **TOPK}, 3),
            resume("one_topk", {**one, **TOPK}, 4, "dp2_topk", 3),
            resume("one_plain", {**one, **TOPK, "compression": "none"}, 4, "dp2_topk", 3,
                   new_marker=True),
            resume("z1rep_topk", {**z1rep, **TOPK}, 4, "z2_topk", 3),
            resume("z1rep_plain", {**z1rep, **TOPK, "compression": "none"}, 4, "z2_topk", 3,
                   new_marker=True),
            # (ZeRO's PowerSGD: data parallelism's aggregator, its residuals)
            write("z2_psgd_sgd", {**z2, **PSGD_SGD}, 3),
            resume("z1rep_psgd", {**z1rep, **PSGD_SGD}, 4, "z2_psgd_sgd", 3),
            resume("z1rep_psgd_plain", {**z1rep, **PSGD_SGD, "compression": "none"}, 4,
                   "z2_psgd_sgd", 3, new_marker=True),
            # Adam in front -> Adam behind, -> Keras's Adam; Keras's Adam -> in front
            write("front", {**dp2, **FRONT}, 3), write("late", {**dp2, **LATE}, 3),
            ref("ref_late", {**dp2, **LATE}, 6), ref("ref_keras", {**dp2, **KERAS}, 6),
            ref("ref_front", {**dp2, **FRONT}, 6),
            resume("late_from_front", {**dp2, **LATE}, 6, "front", 3),
            resume("keras_from_front", {**dp2, **KERAS}, 6, "front", 3, new_marker=True),
            resume("front_from_late", {**dp2, **FRONT}, 6, "late", 3)]},
        {"cpu_devices": 4, "runs": [
            resume("mesh_from_z2_psgd", {**mesh, **BEHIND}, 6, "z2_psgd", 3)]},
        {"cpu_devices": 4, "runs": [resume("z4_from_z2", {**z4, **ADAM}, 4, "z2", 2)]},
    ]


def _state(prefix, name):
    return dict(np.load(f"{prefix}_{name}.npz"))


def _continues(out, prefix, name, ref, tol, exact_load=True):
    """`name`'s steps after its resume and its final weights and optimizer state equal the
    uninterrupted `ref`'s; with `exact_load` every state tensor it loaded read back as
    saved (residuals compared by what they owe)."""
    resumed, whole = out[name], out[ref]
    at = resumed["resumed_from_step"]
    assert at > 0, (name, resumed)
    if exact_load:
        assert resumed["load_diff"] == 0.0, (name, resumed["load_diff"])
    np.testing.assert_allclose(resumed["loss_history"], whole["loss_history"][at:], rtol=0,
                               atol=tol, err_msg=name)
    a, b = _state(prefix, name), _state(prefix, ref)
    for key in (k for k in a if k.startswith(("model|", "optimizer|")) and k in b):
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=tol, err_msg=f"{name} {key}")


def _pays_once(prefix, out, name, plain, writer):
    """`name` (one replica, the codec) took one step from a checkpoint whose 2 rows owe a
    debt; `plain` took the same step from it without the codec: their weights differ by
    `-lr × (the rows' sum)`, and `name`'s residual is 0 after it."""
    paid, without, saved = (_state(prefix, n) for n in (name, plain, writer))
    lr = out[name]["learning_rate"]
    debts = {k[len("codec|"):-len("|residual")]: v.sum(0) for k, v in saved.items()
             if k.endswith("|residual")}
    assert debts and max(np.abs(d).max() for d in debts.values()) * lr > 1e-4, debts
    for path, debt in debts.items():
        weight = "model|" + path
        np.testing.assert_allclose(paid[weight] - without[weight], -lr * debt, rtol=0,
                                   atol=1e-6, err_msg=f"{name} {path}")
        assert not paid[f"codec|{path}|residual"].any(), (name, path)


def test_state_moves_between_zero_mesh_replicas_and_adam_forms(tmp_path):
    prefix = str(tmp_path / "out")
    out, stderr = {}, ""
    for child in _children(tmp_path):
        done = run([sys.executable, CHILD, json.dumps(child), prefix], timeout=600)
        out.update(last_json_line(done.stdout))
        stderr += done.stderr
    # ZeRO-2 ⇄ mesh, Adam behind PowerSGD: each lands in the target's layout.
    _continues(out, prefix, "z2_from_mesh_psgd", "ref_z2_psgd", 1e-5)
    _continues(out, prefix, "mesh_from_z2_psgd", "ref_mesh_psgd", 1e-5)
    assert out["mesh_from_z2_psgd"]["placement"]["dense_0/kernel"]["mesh"] == {
        "batch": 2, "model": 2}
    assert all(len(p["devices"]) == 2
               for p in out["z2_from_mesh_psgd"]["placement"].values())
    # ZeRO-2's sharded slots re-cut for another replica count, read back exactly.
    _continues(out, prefix, "z2_from_z4", "ref_z2", 1e-5)
    _continues(out, prefix, "z4_from_z2", "ref_z4", 1e-5)
    assert all(len(p["devices"]) == 4 for p in out["z4_from_z2"]["placement"].values())
    # One replica pays 2 replicas' debt once.
    _pays_once(prefix, out, "one_topk", "one_plain", "dp2_topk")
    _pays_once(prefix, out, "z1rep_topk", "z1rep_plain", "z2_topk")
    _pays_once(prefix, out, "z1rep_psgd", "z1rep_psgd_plain", "z2_psgd_sgd")
    # Adam's moments: front -> behind, front -> Keras's Adam, Keras's Adam -> front.
    _continues(out, prefix, "late_from_front", "ref_late", 1e-5, exact_load=False)
    _continues(out, prefix, "keras_from_front", "ref_keras", 1e-5, exact_load=False)
    _continues(out, prefix, "front_from_late", "ref_front", 1e-5, exact_load=False)
    assert "carried into Keras's Adam slots" in stderr
    assert "carried into Adam in front" in stderr
    assert "paid on this replica's next step" in stderr
