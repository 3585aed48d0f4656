"""Top-k with Adam in front (frozen `v`): at ratio >= 1 − β₁, after each compressed step every
replica's momentum is the momentum the summed step applied (DeepSpeed 1-bit Adam's synced
momentum), one child process with two replicas that see different gradients.

Without it each replica kept the momentum of its own gradient, which went on pushing the
entries still waiting in its residual: top-k 10 % ended the convnet 4.3× above fp32's loss
(README, Gradient aggregators). The checks: the replicas' momenta are equal and are the step
the weights last moved by (× c1 · s); at ratio 1 (nothing dropped) the weights still equal
frozen-`v` Adam through the exact aggregator.
"""

from subproc import last_json_line, run_python

CHILD = r"""
import json, math
import numpy as np
from tfpar.devices import split_cpu
import tensorflow as tf
split_cpu(2)
import keras
from tfpar.compression import NoneAggregator, TopKAggregator, wrap_optimizer

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
N, LR, WARM, STEPS = 200, 1e-2, 3, 12
ADAM = (0.9, 0.999, 1e-7)  # Adam in front (wrap_optimizer copies the optimizer's values in)
rng = np.random.default_rng(0)
# Per replica, per step: different gradients (a quadratic pull plus replica-own noise).
target = tf.constant(rng.normal(size=N).astype("float32"))
noise = tf.constant(rng.normal(size=(STEPS, 2, N)).astype("float32"))

def run(agg):
    with strategy.scope():
        w = tf.Variable(tf.zeros([N]))
        opt = wrap_optimizer(keras.optimizers.Adam(LR), agg)
        opt.build([w])
    @tf.function
    def step(i):
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            with tf.GradientTape() as tape:
                loss = 0.5 * tf.reduce_sum((w - target) ** 2 + w * noise[i, r]) / 2
            opt.apply_gradients([(tape.gradient(loss, w), w)])
        strategy.run(replica_fn)
    before = m_before = None
    for i in range(STEPS):
        before = w.numpy().copy()
        if agg.built and agg.adam is not None:
            m_before = strategy.experimental_local_results(agg.moments["m_0"])[0].numpy()
        step(tf.constant(i))
    run.m_before = m_before
    return w, before, agg

out = {}
w, before, agg = run(TopKAggregator(0.2, adam=ADAM, adam_warmup_steps=WARM,
                                    adam_momentum_carry=0.0))
m = [v.numpy() for v in strategy.experimental_local_results(agg.moments["m_0"])]
v = strategy.experimental_local_results(agg.moments["v_0"])[0].numpy()
beta_1, beta_2, eps = agg.adam
c1 = 1 - beta_1 ** STEPS
c2 = 1 - beta_2 ** WARM
s = (np.sqrt(v) + eps * math.sqrt(c2)) / math.sqrt(c2)
applied = (before - w.numpy()) / LR  # the summed step of the last step
out["m_replicas_diff"] = float(np.max(np.abs(m[0] - m[1])))
out["m_vs_applied"] = float(np.max(np.abs(m[0] - applied * c1 * s)))
out["m_where_unsent"] = float(np.max(np.abs(m[0][applied == 0])))
out["m_scale"] = float(np.max(np.abs(m[0])))
out["sent_share"] = float(np.mean(applied != 0))
full, _, _ = run(TopKAggregator(1.0, adam=ADAM, adam_warmup_steps=WARM,
                                adam_momentum_carry=0.0))
exact, _, _ = run(NoneAggregator(adam=ADAM, adam_warmup_steps=WARM))
out["full_vs_exact"] = float(np.max(np.abs(full.numpy() - exact.numpy())))
# Momentum carry: β₁ · α of the synced momentum is applied whether or not its entry is sent.
carried, _, _ = run(TopKAggregator(1.0, adam=ADAM, adam_warmup_steps=WARM,
                                   adam_momentum_carry=0.5))
out["carry_full_vs_exact"] = float(np.max(np.abs(carried.numpy() - exact.numpy())))
w, before, agg = run(TopKAggregator(0.2, adam=ADAM, adam_warmup_steps=WARM, union=True,
                                    adam_momentum_carry=0.5))
m = strategy.experimental_local_results(agg.moments["m_0"])[0].numpy()
res = strategy.experimental_local_results(agg.residuals["0"])[0].numpy()
applied = (before - w.numpy()) / LR
unsent = res != 0  # the union: every replica's residual is emptied at the same entries
out["carry_unsent_share"] = float(np.mean(unsent))
out["carry_unsent_err"] = float(np.max(np.abs(
    applied[unsent] - 0.5 * beta_1 * run.m_before[unsent] / c1 / s[unsent])))
out["carry_unsent_scale"] = float(np.max(np.abs(applied[unsent])))
out["carry_m_vs_applied"] = float(np.max(np.abs(m - applied * c1 * s)))
out["carry_m_scale"] = float(np.max(np.abs(m)))
out["moved"] = float(np.max(np.abs(exact.numpy())))
print(json.dumps(out))
"""


def test_topk_adam_momentum_is_synced_and_exact_when_nothing_dropped():
    out = last_json_line(run_python(CHILD, timeout=240).stdout)
    # Compression ran and dropped entries on the last step (each replica sends 40 of 200).
    assert 0 < out["sent_share"] < 0.5, out
    # One momentum on every replica (before: each replica's own, ~the noise apart) ...
    assert out["m_replicas_diff"] == 0.0, out
    # ... and it is what was applied: zero where nothing was sent.
    assert out["m_where_unsent"] == 0.0, out
    assert out["m_vs_applied"] < 1e-4 * out["m_scale"], out
    # Nothing dropped: still frozen-v Adam on the summed gradient.
    assert out["moved"] > 0.05, out
    assert out["full_vs_exact"] < 1e-6, out
    # The momentum carry keeps it exact when nothing is dropped ...
    assert out["carry_full_vs_exact"] < 1e-6, out
    # ... and where no replica sent an entry it still moves, by α · β₁ · m / (c1 · s) (with
    # carry 0 it stays put: m_where_unsent above); the momentum is still what was applied.
    assert 0.3 < out["carry_unsent_share"] < 1, out
    assert out["carry_unsent_scale"] > 0.01, out
    assert out["carry_unsent_err"] < 1e-4 * out["carry_unsent_scale"], out
    assert out["carry_m_vs_applied"] < 1e-4 * out["carry_m_scale"], out


def test_topk_syncs_momentum_only_when_entries_wait_less_than_its_time_constant():
    from tfpar.compression import TopKAggregator
    assert not TopKAggregator(1.0).adam_sync_momentum  # no Adam in front
    for ratio, synced in ((0.01, False), (0.05, False), (0.1, True), (0.3, True)):
        agg = TopKAggregator(ratio)
        agg.adam = (0.9, 0.999, 1e-7)
        assert agg.adam_sync_momentum is synced, ratio


SHARED = r"""
import json, math
import numpy as np
from tfpar.devices import split_cpu
import tensorflow as tf
split_cpu(2)
import keras
from tfpar.compression import NoneAggregator, TopKAggregator, wrap_optimizer

R = 2
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(1)
SHAPES = [(40, 10), (8,)]  # one large tensor (sparse) and one small one (sent whole)
with strategy.scope():
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
STEPS = 3
# Per step and replica: a shared signal plus replica-own noise, so own top-k picks differ.
grads = [[[(rng.normal(size=s) * 0.1 + rng.normal(size=s) * (1 + r)).astype("float32")
           for s in SHAPES] for r in range(R)] for _ in range(STEPS)]

def exchange(agg):
    table = [tf.constant(np.stack([np.stack([grads[t][r][j] for r in range(R)])
                                   for t in range(STEPS)])) for j in range(len(SHAPES))]
    @tf.function
    def step(t):
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            return agg.all_reduce_sum([x[t, rid] for x in table], variables)
        return strategy.run(fn)
    rows = []
    for t in range(STEPS):
        before = [[v.numpy() for v in strategy.experimental_local_results(agg.residuals[str(j)])]
                  for j in range(len(SHAPES))] if agg.built else None
        out = step(tf.constant(t))
        outs = [[o.numpy() for o in strategy.experimental_local_results(x)] for x in out]
        res = [[v.numpy() for v in strategy.experimental_local_results(agg.residuals[str(j)])]
               for j in range(len(SHAPES))]
        corrected = [sum(grads[t][r][j] + (before[j][r] if before else 0) for r in range(R))
                     for j in range(len(SHAPES))]
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
            "sent": int(np.sum(res[0][0] == 0))})
    return rows

out = {"union": exchange(TopKAggregator(0.05, dense_below=8, union=True)),
       "own": exchange(TopKAggregator(0.05))}
print(json.dumps(out))
"""


def test_topk_union_sends_the_same_entries_everywhere_and_small_tensors_whole():
    out = last_json_line(run_python(SHARED, timeout=240).stdout)
    k = 20  # 5 % of 400
    for row in out["union"]:
        assert row["same_out"], row
        # dense_below=8: the (8,) tensor is exact and leaves nothing behind.
        assert row["small_err"] < 1e-5 and row["small_residual"] == 0.0, row
        assert row["conserved"] < 1e-5, row
        # Every replica empties its residual at the same entries (the union of both top-k's),
        # and there the sum is exact: the replicas' noise cancels as uncompressed.
        assert row["emptied_same"] and k <= row["sent"] <= 2 * k, row
        assert row["sent_err"] < 1e-5, row
    # Without the union each replica empties its own top-k (the check above can fail) and
    # a small tensor sends one entry.
    assert not all(row["emptied_same"] for row in out["own"]), out["own"]
    assert all(row["small_residual"] > 0 for row in out["own"]), out["own"]


def test_topk_defaults_are_the_suites_and_bad_settings_are_refused():
    import pytest
    from tfpar import ParallelConfig
    from tfpar.compression import TopKAggregator, make_aggregator
    from tfpar.errors import ConfigError
    agg = make_aggregator(ParallelConfig(compression="topk", optimizer="adam"))
    assert (agg.ratio, agg.union, agg.dense_below, agg.adam_momentum_carry) == (
        0.1, True, 1024, 0.5)
    assert agg.adam_sync_momentum and TopKAggregator(**agg.get_config()).union
    assert agg.k(1024) == 1024 and agg.k(1025) == 103
    with pytest.raises(ConfigError, match="topk_dense_below"):
        ParallelConfig(compression="topk", topk_dense_below=-1)
    with pytest.raises(ConfigError, match="topk_momentum_carry"):
        ParallelConfig(compression="topk", topk_momentum_carry=1.5)
    for kwargs in ({"dense_below": -1}, {"dense_below": 1.5}, {"adam_momentum_carry": 2.0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            TopKAggregator(0.1, **kwargs)
