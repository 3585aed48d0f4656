"""State that moves between optimizers' and codecs' forms on load (`tfpar.state`), each
resumed run against the target's uninterrupted run from the same start (the next steps'
losses and the final weights and optimizer state: 1e-6 SGD, 1e-5 Adam;
`tests/reshard_child.py`). Writers train 2 steps and save;
each resume takes 2 more, against the target trained 4 steps (one such run serves every
resume onto that target):

- ZeRO-2 (2 replicas) ⇄ the dp2×tp2 mesh, Adam behind PowerSGD: optimizer slots, the
  residuals and PowerSGD's Qs under one set of names, each read back exactly and landing
  in the target's layout;
- ZeRO-2's sharded Adam slots written on 2 replicas re-cut for 4 (the other way, a
  4-replica checkpoint cut for ZeRO-1 on 2, is `tests/test_reshard.py`'s);
- one replica loading 2 replicas' error-feedback residuals (data parallel top-k, ZeRO-2
  top-k and PowerSGD): the debt, their sum, paid once on the next step (against the same
  checkpoint resumed without the codec: the weights differ by exactly `-lr × debt`, the
  residual then 0);
- the same debt when the resume's first step is skipped (a NaN, `--on_nan=skip_step`;
  data parallel top-k, ZeRO-2 PowerSGD, written at step 3): paid on the next, applied
  step; and in a user's script loaded after `fit` traced the step (no strategy): paid on
  the next step, once;
- Adam in front of PowerSGD (in its exact warm-up, where its moments are Keras's) resumed
  with Adam behind the codec (before it starts compressing: Keras's Adam's steps) and with
  no codec, both against Keras's Adam; Keras's Adam (behind the codec) resumed with Adam
  in front;
- one replica with Adam in front configured (Keras's Adam takes the steps there) resumed
  on 2 replicas, where the front takes them: Keras's slots into the front's moments;
- past the warm-up (2 steps; written at step 4, 2 more against the front's uninterrupted
  6): Adam in front on 2 replicas loaded on one replica (into Keras's slots, `m` from
  Adam's scaled units), saved there without a step, and loaded back in front.

Two steps after a resume are enough: a moment or residual that did not carry over moves
the first step already (Adam's moments restarted: 4.0e-3 off, the faults guide), and the
second step shows a state the first step's update left wrong.
"""


import numpy as np

from subproc import ROOT, run_children

CHILD = f"{ROOT}/tests/reshard_child.py"
# Width 16: PowerSGD's rank-4 factors are smaller than every kernel (it compresses).
ADAM = {"model_width": 16, "verbose": 0, "powersgd_rank": 4}
# Adam behind PowerSGD: the mesh's (tf.distribute's `--compress_adam_step` default puts it
# in front) and ZeRO 1/2's (always behind).
BEHIND = {**ADAM, "compression": "powersgd", "compress_adam_step": False}
# Top-k drops entries of every tensor (none sent whole); SGD's debt, lr 0.05 (a debt × lr
# far above float32's rounding of the weights).
TOPK = {"model_width": 16, "verbose": 0, "optimizer": "sgd", "learning_rate": 0.05,
        "compression": "topk", "topk_dense_below": 0}
PSGD_SGD = {**TOPK, "compression": "powersgd", "powersgd_rank": 4}
# Adam in front of PowerSGD in its exact warm-up (50 steps by default): the same steps as
# Keras's Adam; and behind PowerSGD before it starts compressing, the same again.
FRONT = {**ADAM, "compression": "powersgd"}
LATE = {**BEHIND, "powersgd_start_step": 100}
KERAS = {**ADAM, "compression": "none"}
# A user's pipeline (tests/user_data.py), and the same with replica 0's batch of step 3 (the
# first after a resume at 3) holding a NaN, skipped by `--on_nan=skip_step`.
USER = {"dataset": "user_data:sign_of_sum", "num_classes": 2}
NAN = {"dataset": "user_data:sign_of_sum_nan_at_step_3", "num_classes": 2,
       "on_nan": "skip_step"}
# Adam in front past its warm-up (2 steps): each replica's own `v`, `m` in Adam's scaled
# units. PowerSGD at rank 16 sends every tensor of width 16 whole (nothing owed, so none
# dropped on the way through Keras's Adam), and every replica takes the same batch, so
# the rows alike survive their mean.
PAST = {**FRONT, "powersgd_rank": 16, "adam_warmup_steps": 2,
        "dataset": "user_data:sign_of_sum_alike_on_replicas", "num_classes": 2}


def _children(tmp):
    def d(name):
        return str(tmp / name)

    def write(name, settings, steps=2):
        return [name, {**settings, "steps": steps, "checkpoint_dir": d(name)}, {}]

    def ref(name, settings, steps=4):
        return [name, {**settings, "steps": steps}, {}]

    def resume(name, settings, source, steps=4, at=2, **options):
        return [name, {**settings, "steps": steps, "checkpoint_dir": d(name)},
                {"from": d(source), "at": at, **options}]

    def pay(name, settings, source, **options):
        # One step from the loaded debt; the record of the load-only pass is not needed.
        return resume(name, settings, source, steps=3, landing=False, **options)

    def pay_after_skip(name, settings, source):
        # Written at step 3; the resume's first step (3) is skipped, the next applied.
        return resume(name, {**settings, **NAN}, source, steps=5, at=3, landing=False,
                      new_marker=True)
    mesh = {"cpu_devices": 4, "data_parallel": 2, "tensor_parallel": 2}
    z2 = {"cpu_devices": 2, "data_parallel": 2, "strategy": "mirrored", "zero_stage": 2}
    z4 = {**z2, "cpu_devices": 4, "data_parallel": 4}
    dp2 = {"cpu_devices": 2, "data_parallel": 2, "strategy": "mirrored"}
    one = {"cpu_devices": 2, "data_parallel": 1, "strategy": "one_device"}
    z1rep = {**z2, "data_parallel": 1}
    none = {"compression": "none"}
    # Four children: a DTensor mesh, ZeRO on 2 and ZeRO on 4 replicas each need a process
    # of their own (TensorFlow's collective group keys collide), and the mesh and ZeRO on
    # 2 each load the other's checkpoint.
    return [
        {"cpu_devices": 2, "runs": [
            # The writers, 2 steps each; the targets' uninterrupted runs.
            write("z2_psgd", {**z2, **BEHIND}), write("z2", {**z2, **ADAM}),
            write("dp2_topk", {**dp2, **TOPK}), write("z2_topk", {**z2, **TOPK}),
            write("z2_psgd_sgd", {**z2, **PSGD_SGD}), write("front", {**dp2, **FRONT}),
            write("late", {**dp2, **LATE}), ref("ref_keras", {**dp2, **KERAS}),
            ref("ref_front", {**dp2, **FRONT}),
            # One replica owes 2 replicas' debt.
            pay("one_topk", {**one, **TOPK}, "dp2_topk"),
            pay("one_plain", {**one, **TOPK, **none}, "dp2_topk", new_marker=True),
            pay("z1rep_topk", {**z1rep, **TOPK}, "z2_topk"),
            pay("z1rep_plain", {**z1rep, **TOPK, **none}, "z2_topk", new_marker=True),
            pay("z1rep_psgd", {**z1rep, **PSGD_SGD}, "z2_psgd_sgd"),
            pay("z1rep_psgd_plain", {**z1rep, **PSGD_SGD, **none}, "z2_psgd_sgd",
                new_marker=True),
            # ... and a step skipped for a NaN first: the debt waits for the applied one.
            write("dp2_topk_user", {**dp2, **TOPK, **USER}, steps=3),
            write("z2_psgd_user", {**z2, **PSGD_SGD, **USER}, steps=3),
            pay_after_skip("one_topk_skip", {**one, **TOPK}, "dp2_topk_user"),
            pay_after_skip("one_plain_skip", {**one, **TOPK, **none}, "dp2_topk_user"),
            pay_after_skip("z1rep_psgd_skip", {**z1rep, **PSGD_SGD}, "z2_psgd_user"),
            pay_after_skip("z1rep_psgd_plain_skip", {**z1rep, **PSGD_SGD, **none},
                           "z2_psgd_user"),
            # One replica with Adam in front configured (Keras's Adam takes the steps)
            # resumed where the front takes them.
            write("one_front", {**one, **FRONT}),
            resume("front_from_one", {**dp2, **FRONT}, "one_front", landing=False),
            # Past the warm-up: in front (dp2, 4 steps) -> one replica's Keras's Adam (no
            # step, saved there) -> in front (dp2), against in front uninterrupted.
            write("front_past", {**dp2, **PAST}, steps=4),
            ref("ref_front_past", {**dp2, **PAST}, steps=6),
            resume("one_past", {**one, **PAST}, "front_past", at=4, resave=True),
            resume("front_past_from_one", {**dp2, **PAST}, "one_past", steps=6, at=4,
                   landing=False),
            # Adam in front -> Adam behind, -> Keras's Adam; Keras's Adam -> in front.
            resume("late_from_front", {**dp2, **LATE}, "front", landing=False),
            resume("keras_from_front", {**dp2, **KERAS}, "front", landing=False,
                   new_marker=True),
            resume("front_from_late", {**dp2, **FRONT}, "late", landing=False)]},
        {"cpu_devices": 4, "runs": [
            write("mesh_psgd", {**mesh, **BEHIND}), ref("ref_mesh_psgd", {**mesh, **BEHIND}),
            resume("mesh_from_z2_psgd", {**mesh, **BEHIND}, "z2_psgd")]},
        {"cpu_devices": 2, "runs": [
            ref("ref_z2_psgd", {**z2, **BEHIND}),
            resume("z2_from_mesh_psgd", {**z2, **BEHIND}, "mesh_psgd")]},
        # ZeRO-2's slots re-cut 2 -> 4.
        {"cpu_devices": 4, "runs": [ref("ref_z4", {**z4, **ADAM}),
                                    resume("z4_from_z2", {**z4, **ADAM}, "z2")]},
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
    """`name` (one replica, the codec) took one applied step from a checkpoint whose 2 rows
    owe a debt; `plain` took the same step from it without the codec: their weights differ
    by `-lr × (the rows' sum)`, and `name`'s residual is 0 after it."""
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
    out, stderr = run_children(CHILD, _children(tmp_path), prefix)
    # ZeRO-2 ⇄ mesh, Adam behind PowerSGD: each lands in the target's layout.
    _continues(out, prefix, "z2_from_mesh_psgd", "ref_z2_psgd", 1e-5)
    _continues(out, prefix, "mesh_from_z2_psgd", "ref_mesh_psgd", 1e-5)
    assert out["mesh_from_z2_psgd"]["placement"]["dense_0/kernel"]["mesh"] == {
        "batch": 2, "model": 2}
    assert all(len(p["devices"]) == 2
               for p in out["z2_from_mesh_psgd"]["placement"].values())
    # ZeRO-2's sharded slots re-cut for more replicas, read back exactly.
    _continues(out, prefix, "z4_from_z2", "ref_z4", 1e-5)
    assert all(len(p["devices"]) == 4 for p in out["z4_from_z2"]["placement"].values())
    # One replica pays 2 replicas' debt once.
    _pays_once(prefix, out, "one_topk", "one_plain", "dp2_topk")
    _pays_once(prefix, out, "z1rep_topk", "z1rep_plain", "z2_topk")
    _pays_once(prefix, out, "z1rep_psgd", "z1rep_psgd_plain", "z2_psgd_sgd")
    # The first step after the resume skipped (its gradients NaN: one step counted), the
    # next applied: the debt paid on that one (before, spent on the skipped step: the
    # weights equal the plain run's).
    for name, plain, writer in (("one_topk_skip", "one_plain_skip", "dp2_topk_user"),
                                ("z1rep_psgd_skip", "z1rep_psgd_plain_skip", "z2_psgd_user")):
        for run_ in (name, plain):
            assert _state(prefix, run_)["optimizer|nonfinite_steps"] == 1, run_
        _pays_once(prefix, out, name, plain, writer)
    # Adam's moments: front -> behind, front -> Keras's Adam, Keras's Adam -> front.
    _continues(out, prefix, "late_from_front", "ref_keras", 1e-5, exact_load=False)
    _continues(out, prefix, "keras_from_front", "ref_keras", 1e-5, exact_load=False)
    _continues(out, prefix, "front_from_late", "ref_front", 1e-5, exact_load=False)
    # One replica's Keras's Adam (Adam in front configured, not stepping) -> in front.
    _continues(out, prefix, "front_from_one", "ref_front", 1e-5, exact_load=False)
    # Past the warm-up, through Keras's Adam and back: m in Adam's scaled units each way.
    assert "(m in scaled units, after 4 steps) carried into Keras's Adam slots" in stderr
    _continues(out, prefix, "front_past_from_one", "ref_front_past", 1e-5, exact_load=False)
    assert "carried into Keras's Adam slots" in stderr
    assert "carried into Adam in front" in stderr
    assert "paid on this replica's next applied step" in stderr


def test_debt_loaded_after_the_step_was_traced_is_paid():
    # A user's script on one replica (no strategy): fit, load a checkpoint that owes a debt
    # (here its residuals set as a load sets them), fit on. The step was traced before the
    # load; the debt is still paid on the next step, once (before, a flag read while
    # tracing: never paid after the first trace, and zeros paid on every step of a run
    # traced with it).
    import keras

    import tfpar
    from tfpar import state
    from tfpar.compression import keras_hook

    def fitted(compression):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
        optimizer = keras.optimizers.SGD(0.1)
        if compression:
            optimizer = tfpar.DistributedOptimizer(optimizer, compression=compression)
        model.compile(optimizer=optimizer, loss="mse")
        return model
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(3, 8, 4)).astype("float32"), rng.normal(size=(3, 8, 3))
    paid, plain = fitted("int8"), fitted(None)
    for model in (paid, plain):
        model.fit(x[0], y[0], batch_size=8, verbose=0)
    aggregator = keras_hook.aggregator_of(paid.optimizer)
    debts = {}
    for position, residual in aggregator.residuals.items():
        debts[position] = rng.normal(size=residual.shape).astype("float32")
        residual.assign(debts[position])
    state._owe_on_one_replica(paid, "ckpt-2")
    for model in (paid, plain):
        model.fit(x[1], y[1], batch_size=8, verbose=0)
    for w, v in zip(paid.trainable_weights, plain.trainable_weights):
        debt = debts[str(aggregator.position_of(w))]
        np.testing.assert_allclose(np.asarray(w) - np.asarray(v), -0.1 * debt, rtol=0,
                                   atol=1e-6, err_msg=w.path)
    assert not any(np.any(np.asarray(r)) for r in aggregator.residuals.values())
    # Not paid again: the next step is the plain optimizer's from the same weights.
    plain.set_weights(paid.get_weights())
    for model in (paid, plain):
        model.fit(x[2], y[2], batch_size=8, verbose=0)
    for w, v in zip(paid.trainable_weights, plain.trainable_weights):
        np.testing.assert_allclose(np.asarray(w), np.asarray(v), rtol=0, atol=1e-6,
                                   err_msg=w.path)


def test_debt_of_an_unused_layer_stays_owed():
    # A subclassed model with a Dense its call never uses (Keras drops its None gradients),
    # int8 on one replica, loading a debt for both: the step pays the used layer's, keeps
    # the unused one's residual and the flag (before: the flag cleared, that residual never
    # paid in this process and saved on as if owed by nothing).
    import keras

    import tfpar
    from tfpar import state
    from tfpar.compression import keras_hook

    class Unused(keras.Model):
        def __init__(self):
            super().__init__()
            self.used = keras.layers.Dense(3, name="used")
            self.unused = keras.layers.Dense(3, name="unused")

        def call(self, x):
            return self.used(x)

    keras.utils.set_random_seed(0)
    model = Unused()
    model.compile(optimizer=tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                       compression="int8"), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2, 8, 4)).astype("float32"), rng.normal(size=(2, 8, 3))
    model(x[0])
    model.unused(x[0])
    model.fit(x[0], y[0], batch_size=8, verbose=0)
    aggregator = keras_hook.aggregator_of(model.optimizer)
    unused = {str(aggregator.position_of(w)) for w in model.unused.trainable_weights}
    assert unused <= set(aggregator.residuals)
    for residual in aggregator.residuals.values():
        residual.assign(np.ones(residual.shape, "float32"))
    state._owe_on_one_replica(model, "ckpt-1")
    model.fit(x[1], y[1], batch_size=8, verbose=0)
    for position, residual in aggregator.residuals.items():
        assert np.all(np.asarray(residual) == (1.0 if position in unused else 0.0)), position
    assert bool(np.asarray(aggregator.debt_owed))
