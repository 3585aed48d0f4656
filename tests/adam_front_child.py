"""Child process for tests/test_compression_adam_front.py: `python tests/adam_front_child.py`.

Aggregators with Adam in front on one `MirroredStrategy` of two logical CPUs whose
replicas see different gradients (one strategy per process: the four probes share it,
and TensorFlow is imported once for all). Prints one JSON line `{"topk_momentum": {...},
"topk_union": {...}, "powersgd_variance": {...}, "powersgd_local": {...}}`; what each
figure means is asserted, and said, in the test file.
"""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfpar.devices import split_cpu  # noqa: E402

import tensorflow as tf  # noqa: E402

split_cpu(2)

import keras  # noqa: E402

from tfpar.compression import (NoneAggregator, PowerSGDAggregator, TopKAggregator,  # noqa: E402
                               wrap_optimizer)

ADAM = (0.9, 0.999, 1e-7)  # Adam in front (wrap_optimizer copies the optimizer's values in)
STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def local(value, replica=0):
    return STRATEGY.experimental_local_results(value)[replica].numpy()


def train(agg, shape, lr, steps, replica_loss, record=None, at=()):
    """`steps` steps of `replica_loss(w, i, replica)` through `agg` with Adam in front;
    returns `(w, seen)`: the weights and `{i: record(w, agg)}` after each step `i` in `at`."""
    with STRATEGY.scope():
        w = tf.Variable(tf.zeros(shape))
        opt = wrap_optimizer(keras.optimizers.Adam(lr), agg)
        opt.build([w])

    @tf.function
    def step(i):
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            with tf.GradientTape() as tape:
                loss = replica_loss(w, i, r)
            opt.apply_gradients([(tape.gradient(loss, w), w)])
        STRATEGY.run(replica_fn)

    seen = {}
    for i in range(steps):
        step(tf.constant(i))
        if i in at:
            seen[i] = record(w, agg)
    return w.numpy(), seen


def numpy_adam(grads, lr):
    """Keras's Adam (ADAM's betas and epsilon) in NumPy on `grads` (one per step), from zero
    weights: `(w, v)` after the last step."""
    beta_1, beta_2, eps = ADAM
    m = v = w = 0
    for t, grad in enumerate(grads, 1):
        m = beta_1 * m + (1 - beta_1) * grad
        v = beta_2 * v + (1 - beta_2) * grad * grad
        w = w - lr * (m / (1 - beta_1 ** t)) / (np.sqrt(v / (1 - beta_2 ** t)) + eps)
    return w, v


def topk_momentum():
    """Top-k at ratio >= 1 − β₁ syncs every replica's momentum to the summed step's; ratio
    1 equals frozen-`v` Adam through the exact aggregator; the momentum carry."""
    n, lr, warm, steps = 200, 1e-2, 3, 12
    rng = np.random.default_rng(0)
    # Per replica, per step: different gradients (a quadratic pull plus replica-own noise).
    target = tf.constant(rng.normal(size=n).astype("float32"))
    noise = tf.constant(rng.normal(size=(steps, 2, n)).astype("float32"))

    def loss(w, i, r):
        return 0.5 * tf.reduce_sum((w - target) ** 2 + w * noise[i, r]) / 2

    def before_last(w, agg):  # after the last-but-one step: the state the last step met
        return {"w": w.numpy().copy(), "m": local(agg.moments["m_0"])}

    def run(agg):
        w, seen = train(agg, [n], lr, steps, loss, before_last, at=(steps - 2,))
        return w, seen[steps - 2], agg

    out = {}
    w, last, agg = run(TopKAggregator(0.2, adam=ADAM, adam_warmup_steps=warm,
                                      adam_momentum_carry=0.0, union=False, dense_below=0))
    m = [local(agg.moments["m_0"], r) for r in (0, 1)]
    v = local(agg.moments["v_0"])
    beta_1, beta_2, eps = agg.adam
    c1 = 1 - beta_1 ** steps
    c2 = 1 - beta_2 ** warm
    s = (np.sqrt(v) + eps * math.sqrt(c2)) / math.sqrt(c2)
    applied = (last["w"] - w) / lr  # the summed step of the last step
    out["m_replicas_diff"] = float(np.max(np.abs(m[0] - m[1])))
    out["m_vs_applied"] = float(np.max(np.abs(m[0] - applied * c1 * s)))
    out["m_where_unsent"] = float(np.max(np.abs(m[0][applied == 0])))
    out["m_scale"] = float(np.max(np.abs(m[0])))
    out["sent_share"] = float(np.mean(applied != 0))
    full, _, _ = run(TopKAggregator(1.0, adam=ADAM, adam_warmup_steps=warm,
                                    adam_momentum_carry=0.0, union=False, dense_below=0))
    exact, _, _ = run(NoneAggregator(adam=ADAM, adam_warmup_steps=warm))
    out["full_vs_exact"] = float(np.max(np.abs(full - exact)))
    # Momentum carry: β₁ · α of the synced momentum is applied whether or not its entry is sent.
    carried, _, _ = run(TopKAggregator(1.0, adam=ADAM, adam_warmup_steps=warm,
                                       adam_momentum_carry=0.5, union=False, dense_below=0))
    out["carry_full_vs_exact"] = float(np.max(np.abs(carried - exact)))
    w, last, agg = run(TopKAggregator(0.2, adam=ADAM, adam_warmup_steps=warm, union=True,
                                      adam_momentum_carry=0.5, dense_below=0))
    m = local(agg.moments["m_0"])
    res = local(agg.residuals["0"])
    applied = (last["w"] - w) / lr
    unsent = res != 0  # the union: every replica's residual is emptied at the same entries
    out["carry_unsent_share"] = float(np.mean(unsent))
    out["carry_unsent_err"] = float(np.max(np.abs(
        applied[unsent] - 0.5 * beta_1 * last["m"][unsent] / c1 / s[unsent])))
    out["carry_unsent_scale"] = float(np.max(np.abs(applied[unsent])))
    out["carry_m_vs_applied"] = float(np.max(np.abs(m - applied * c1 * s)))
    out["carry_m_scale"] = float(np.max(np.abs(m)))
    out["moved"] = float(np.max(np.abs(exact)))
    return out


def topk_union():
    """One exchange per step, union vs each replica's own top-k, with a small tensor."""
    replicas, steps = 2, 3
    rng = np.random.default_rng(1)
    shapes = [(40, 10), (8,)]  # one large tensor (sparse) and one small one (sent whole)
    with STRATEGY.scope():
        variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    # Per step and replica: a shared signal plus replica-own noise, so own top-k picks differ.
    grads = [[[(rng.normal(size=s) * 0.1 + rng.normal(size=s) * (1 + r)).astype("float32")
               for s in shapes] for r in range(replicas)] for _ in range(steps)]

    def exchange(agg):
        table = [tf.constant(np.stack([np.stack([grads[t][r][j] for r in range(replicas)])
                                       for t in range(steps)])) for j in range(len(shapes))]

        @tf.function
        def step(t):
            def fn():
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                return agg.all_reduce_sum([x[t, rid] for x in table], variables)
            return STRATEGY.run(fn)

        def residuals():
            return [[local(agg.residuals[str(j)], r) for r in range(replicas)]
                    for j in range(len(shapes))]

        rows = []
        for t in range(steps):
            before = residuals() if agg.built else None
            out = step(tf.constant(t))
            outs = [[local(x, r) for r in range(replicas)] for x in out]
            res = residuals()
            corrected = [sum(grads[t][r][j] + (before[j][r] if before else 0)
                             for r in range(replicas)) for j in range(len(shapes))]
            rows.append({
                "same_out": all(np.array_equal(o[0], o[1]) for o in outs),
                "small_err": float(np.max(np.abs(outs[1][0] - corrected[1]))),
                "small_residual": float(np.max(np.abs(res[1][0]))),
                # error feedback keeps everything: sum + residuals = corrected gradients
                "conserved": float(max(np.max(np.abs(outs[j][0] + res[j][0] + res[j][1]
                                                     - corrected[j])) for j in range(2))),
                "emptied_same": bool(np.array_equal(res[0][0] == 0, res[0][1] == 0)),
                # where sent, the exact sum of both replicas' corrected values
                "sent_err": float(np.max(np.abs((outs[0][0] - corrected[0])[res[0][0] == 0]))),
                "sent": int(np.sum(res[0][0] == 0)),
                "bytes": agg.comm_stats()["bytes_on_wire_per_step"],
                "expected_bytes": agg.wire_bytes_at(t)})
        return rows

    # bucket_mb=1e-6: each tensor in a bucket of its own, so the small one's bucket is
    # sent whole alone (no index all-gather).
    return {"union": exchange(TopKAggregator(0.05, dense_below=8, union=True)),
            "union_alone": exchange(TopKAggregator(0.05, dense_below=8, union=True,
                                                   bucket_mb=1e-6)),
            "own_whole": exchange(TopKAggregator(0.05, dense_below=8, union=False)),
            "own_whole_alone": exchange(TopKAggregator(0.05, dense_below=8, bucket_mb=1e-6,
                                                       union=False)),
            "own": exchange(TopKAggregator(0.05, union=False, dense_below=0)),
            # 40 %: the union's message (k index + 2k values) would outgrow the values
            # themselves, so both tensors go whole; each replica's own pairs (2k) would not.
            "union_dense": exchange(TopKAggregator(0.4, union=True, dense_below=0)),
            "own_dense": exchange(TopKAggregator(0.4, union=False, dense_below=0))}


def powersgd_variance():
    """PowerSGD with a live `v` and with exact refresh steps of `v`."""
    n, m_cols, lr, warm, every, steps = 24, 16, 1e-2, 3, 4, 9
    rng = np.random.default_rng(0)
    # Per step, per replica: a gradient zero outside rows 0 and 1 (rank 2 whatever scales
    # its entries; constant in w, so known in advance), growing over the steps so that the
    # frozen v is visibly not Adam's.
    g = np.zeros((steps, 2, n, m_cols), "float32")
    g[:, :, :2] = rng.normal(size=(steps, 2, 2, m_cols)) * (1 + np.arange(steps))[:, None, None,
                                                                                    None]
    g_t = tf.constant(g)
    summed = g.sum(1) / 2  # what the replicas' gradients (each loss / 2) sum to

    def loss(w, i, r):
        return tf.reduce_sum(w * g_t[i, r]) / 2

    def v_and_residuals(w, agg):
        return {"v": local(agg.moments["v_0"]),
                "r": [local(agg.residuals["0"], r) for r in (0, 1)]}

    def run(agg, probe=()):
        w, seen = train(agg, [n, m_cols], lr, steps, loss, v_and_residuals, at=probe)
        return w, local(agg.moments["v_0"]), seen

    beta_1, beta_2, eps = ADAM
    w, v = numpy_adam(summed, lr)
    out = {"moved": float(np.abs(w).max())}
    live_w, live_v, _ = run(PowerSGDAggregator(2, adam=ADAM, adam_warmup_steps=warm,
                                               adam_variance="live"))
    out["live_w"] = float(np.abs(live_w - w).max())
    out["live_v"] = float(np.abs(live_v - v).max() / np.abs(v).max())
    frozen_w, _, _ = run(PowerSGDAggregator(2, adam=ADAM, adam_warmup_steps=warm))
    out["frozen_w"] = float(np.abs(frozen_w - w).max())

    refresh = warm + every - 1  # the first exact step after the warm-up (0-based)
    _, _, seen = run(PowerSGDAggregator(1, adam=ADAM, adam_warmup_steps=warm,
                                        adam_refresh_every=every),
                     probe=(warm - 1, refresh - 1, refresh))
    before, after = seen[refresh - 1], seen[refresh]
    out["frozen_between"] = float(np.abs(before["v"] - seen[warm - 1]["v"]).max())
    decay = beta_2 ** every
    want = decay * before["v"] + (1 - decay) * summed[refresh] ** 2
    out["refresh_v"] = float(np.abs(after["v"] - want).max() / np.abs(want).max())
    out["refresh_v_moved"] = float(np.abs(after["v"] - before["v"]).max() / np.abs(want).max())

    def scale(v, t):
        c2 = 1 - beta_2 ** t
        return (np.sqrt(v) + eps * math.sqrt(c2)) / math.sqrt(c2)
    ratio = scale(before["v"], warm) / scale(after["v"], warm + every)
    out["residual"] = float(max(np.abs(b * ratio - a).max() / np.abs(b).max()
                                for b, a in zip(before["r"], after["r"])))
    out["residual_held"] = float(min(np.abs(b).max() for b in before["r"]))
    return out


def powersgd_local_variance():
    """PowerSGD with `adam_variance="local"` / `"local_debiased"`, nothing lost (rank-2
    gradients at rank 2), replicas seeing different gradients: against a NumPy model of the
    method, and with one gradient for both replicas against NumPy Adam."""
    n, m_cols, lr, warm, steps = 24, 16, 1e-2, 3, 9
    rng = np.random.default_rng(2)
    g = np.zeros((steps, 2, n, m_cols), "float32")
    # A shared signal plus replica-own noise in rows 0 and 1 (rank 2 after any elementwise
    # scaling), so each replica's own v differs from the summed gradient's.
    g[:, :, :2] = (rng.normal(size=(steps, 1, 2, m_cols)) +
                   rng.normal(size=(steps, 2, 2, m_cols)) * 2)
    beta_1, beta_2, eps = ADAM

    def reference(grads, variance):
        """The method in NumPy: exact Adam on the sum for `warm` steps, then per replica."""
        m = w = 0.0
        v = [0.0, 0.0]
        for t in range(1, steps + 1):
            share = grads[t - 1] / 2  # each replica's loss is halved
            c1, c2, c2_old = 1 - beta_1 ** t, 1 - beta_2 ** t, 1 - beta_2 ** (t - 1)
            if t <= warm:
                summed = share.sum(0)
                m = beta_1 * m + (1 - beta_1) * summed
                v = [beta_2 * v[0] + (1 - beta_2) * summed ** 2] * 2
                w = w - lr * m * (math.sqrt(c2) / c1) / (np.sqrt(v[0]) + eps)
                continue
            first = t == warm + 1  # m still in the gradient's units, v the same on both
            s_old = [np.sqrt(v[r] / c2_old) + eps for r in (0, 1)]
            u = 0.0
            for r in (0, 1):
                if variance == "local":
                    square = (2 * share[r]) ** 2
                else:  # the summed gradient's estimate from the momentum
                    g_hat = (m if first else m * s_old[r]) / (1 - beta_1 ** (t - 1))
                    square = 2 * share[r] ** 2 + 0.5 * g_hat ** 2
                v[r] = beta_2 * v[r] + (1 - beta_2) * square
                u = u + share[r] / (np.sqrt(v[r] / c2) + eps)
            if first:
                m = m / s_old[0]  # into the scaled units
            m = beta_1 * m + (1 - beta_1) * u
            w = w - lr * m / c1
        return w, v

    def run(grads, variance, make=None):
        g_t = tf.constant(grads)

        def loss(w, i, r):
            return tf.reduce_sum(w * g_t[i, r]) / 2

        def per_replica(w, agg):
            return [[local(x, r) for r in (0, 1)]
                    for x in (w, agg.moments["m_0"], agg.moments["v_0"])]

        agg = (make or (lambda **kw: PowerSGDAggregator(2, **kw)))(adam=ADAM, adam_warmup_steps=warm,
                                           adam_variance=variance)
        _, seen = train(agg, [n, m_cols], lr, steps, loss, per_replica, at=(steps - 1,))
        return seen[steps - 1]  # [ws, ms, vs], each per replica

    def compare(ws, ms, vs, variance, grads=g):
        w_ref, v_ref = reference(grads, variance)
        moved = float(np.abs(w_ref).max())
        return {
            "moved": moved,
            "w": float(np.abs(ws[0] - w_ref).max() / moved),
            "v": float(max(np.abs(vs[r] - v_ref[r]).max() / np.abs(v_ref[r]).max()
                           for r in (0, 1))),
            "w_replicas_diff": float(np.abs(ws[0] - ws[1]).max()),
            "m_replicas_diff": float(np.abs(ms[0] - ms[1]).max()),
            "v_replicas_apart": float(np.abs(vs[0] - vs[1]).max() / np.abs(vs[0]).max())}

    out = {}
    for variance in ("local", "local_debiased"):
        out[variance] = compare(*run(g, variance), variance)
    # Top-k compresses each replica's step, the synced momentum kept in the scaled units:
    # with nothing dropped (ratio 1, carry 0.5) the same method, so the same NumPy model.
    # At 10 % of a dense gradient (entries held in the residuals) the weights and momenta
    # still stay identical on both replicas.
    dense = (g + np.random.default_rng(3).normal(size=g.shape) * 0.1).astype("float32")
    for ratio, grads in ((1.0, g), (0.1, dense)):
        ws, ms, vs = run(grads, "local_debiased", lambda **kw: TopKAggregator(
            ratio, union=True, dense_below=0, adam_momentum_carry=0.5, **kw))
        out[f"topk_{ratio}"] = compare(ws, ms, vs, "local_debiased", grads)
    # One gradient for both replicas, each entry of one magnitude on every step (random
    # signs): each replica's v is the summed gradient's and Adam's denominator stays put, so
    # the momentum of scaled gradients is Adam's scaled momentum: the method is Adam.
    signs = np.sign(rng.normal(size=(steps, 1, 2, m_cols)))
    same = np.zeros_like(g)
    same[:, :, :2] = signs * np.abs(rng.normal(size=(1, 1, 2, m_cols)))
    same = same.astype("float32")
    ws, _, _ = run(same, "local")
    w, _ = numpy_adam(same[:, 0], lr)
    out["same_data_vs_adam"] = float(np.abs(ws[0] - w).max() / np.abs(w).max())
    # With different data it is not Adam on the sum (so the comparison with the NumPy model
    # above could fail): each replica's v holds its own noise.
    w, _ = numpy_adam(g.sum(1) / 2, lr)
    out["local_vs_adam"] = float(np.abs(reference(g, "local")[0] - w).max() / np.abs(w).max())
    return out


def main():
    print(json.dumps({"topk_momentum": topk_momentum(), "topk_union": topk_union(),
                      "powersgd_variance": powersgd_variance(),
                      "powersgd_local": powersgd_local_variance()}), flush=True)


if __name__ == "__main__":
    main()
