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
    before = None
    for i in range(STEPS):
        before = w.numpy().copy()
        step(tf.constant(i))
    return w, before, agg

out = {}
w, before, agg = run(TopKAggregator(0.2, adam=ADAM, adam_warmup_steps=WARM))
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
full, _, _ = run(TopKAggregator(1.0, adam=ADAM, adam_warmup_steps=WARM))
exact, _, _ = run(NoneAggregator(adam=ADAM, adam_warmup_steps=WARM))
out["full_vs_exact"] = float(np.max(np.abs(full.numpy() - exact.numpy())))
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


def test_topk_syncs_momentum_only_when_entries_wait_less_than_its_time_constant():
    from tfpar.compression import TopKAggregator
    assert not TopKAggregator(1.0).adam_sync_momentum  # no Adam in front
    for ratio, synced in ((0.01, False), (0.05, False), (0.1, True), (0.3, True)):
        agg = TopKAggregator(ratio)
        agg.adam = (0.9, 0.999, 1e-7)
        assert agg.adam_sync_momentum is synced, ratio
