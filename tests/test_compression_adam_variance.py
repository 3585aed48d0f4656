"""PowerSGD with Adam in front, `v` not frozen (`Aggregator.set_adam_variance`), one child
process with two replicas that see different gradients.

- `adam_variance="live"`: `v` takes the square of the summed gradient compression delivered,
  every step. With nothing lost (every gradient is zero outside two rows, so rank 2 is
  exact, also after Adam's elementwise scaling) that is Adam on the summed gradient: `v` and the weights equal
  a NumPy Adam's; the frozen `v` (the default) does not.
- `adam_refresh_every=K` (0/1 Adam's exact variance steps): at rank 1 (lossy, residuals
  held), the refresh step's `v` is `β₂ᴷ v + (1 − β₂ᴷ) g²` of the exact summed gradient, `v`
  stays put between refreshes, and each replica's residual (held as gradient / Adam's
  denominator) is rescaled so the gradient still owed is unchanged.
"""

from subproc import last_json_line, run_python

CHILD = r"""
import json, math
import numpy as np
from tfpar.devices import split_cpu
import tensorflow as tf
split_cpu(2)
import keras
from tfpar.compression import PowerSGDAggregator, wrap_optimizer

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
N, M, LR, WARM, EVERY, STEPS = 24, 16, 1e-2, 3, 4, 9
ADAM = (0.9, 0.999, 1e-7)
rng = np.random.default_rng(0)
# Per step, per replica: a gradient zero outside rows 0 and 1 (rank 2 whatever scales its
# entries; constant in w, so known in advance), growing over the steps so that the frozen
# v is visibly not Adam's.
G = np.zeros((STEPS, 2, N, M), "float32")
G[:, :, :2] = rng.normal(size=(STEPS, 2, 2, M)) * (1 + np.arange(STEPS))[:, None, None, None]
G_t = tf.constant(G)
SUMMED = G.sum(1) / 2  # what the replicas' gradients (each loss / 2) sum to

def run(agg, probe=()):
    with strategy.scope():
        w = tf.Variable(tf.zeros([N, M]))
        opt = wrap_optimizer(keras.optimizers.Adam(LR), agg)
        opt.build([w])
    @tf.function
    def step(i):
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * G_t[i, r]) / 2
            opt.apply_gradients([(tape.gradient(loss, w), w)])
        strategy.run(replica_fn)
    seen = {}
    for i in range(STEPS):
        step(tf.constant(i))
        if i in probe:
            seen[i] = {"v": strategy.experimental_local_results(agg.moments["v_0"])[0].numpy(),
                       "r": [x.numpy() for x in
                             strategy.experimental_local_results(agg.residuals["0"])]}
    v = strategy.experimental_local_results(agg.moments["v_0"])[0].numpy()
    return w.numpy(), v, seen

# NumPy Adam on the summed gradient.
beta_1, beta_2, eps = ADAM
m = v = w = 0
for t, g in enumerate(SUMMED, 1):
    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g * g
    w = w - LR * (m / (1 - beta_1 ** t)) / (np.sqrt(v / (1 - beta_2 ** t)) + eps)
out = {"moved": float(np.abs(w).max())}
live_w, live_v, _ = run(PowerSGDAggregator(2, adam=ADAM, adam_warmup_steps=WARM,
                                           adam_variance="live"))
out["live_w"] = float(np.abs(live_w - w).max())
out["live_v"] = float(np.abs(live_v - v).max() / np.abs(v).max())
frozen_w, _, _ = run(PowerSGDAggregator(2, adam=ADAM, adam_warmup_steps=WARM))
out["frozen_w"] = float(np.abs(frozen_w - w).max())

refresh = WARM + EVERY - 1  # the first exact step after the warm-up (0-based)
_, _, seen = run(PowerSGDAggregator(1, adam=ADAM, adam_warmup_steps=WARM,
                                    adam_refresh_every=EVERY),
                 probe=(WARM - 1, refresh - 1, refresh))
before, after = seen[refresh - 1], seen[refresh]
out["frozen_between"] = float(np.abs(before["v"] - seen[WARM - 1]["v"]).max())
decay = beta_2 ** EVERY
want = decay * before["v"] + (1 - decay) * SUMMED[refresh] ** 2
out["refresh_v"] = float(np.abs(after["v"] - want).max() / np.abs(want).max())
out["refresh_v_moved"] = float(np.abs(after["v"] - before["v"]).max() / np.abs(want).max())
def scale(v, t):
    c2 = 1 - beta_2 ** t
    return (np.sqrt(v) + eps * math.sqrt(c2)) / math.sqrt(c2)
ratio = scale(before["v"], WARM) / scale(after["v"], WARM + EVERY)
out["residual"] = float(max(np.abs(b * ratio - a).max() / np.abs(b).max()
                            for b, a in zip(before["r"], after["r"])))
out["residual_held"] = float(min(np.abs(b).max() for b in before["r"]))
print(json.dumps(out))
"""


def test_live_and_refreshed_adam_variance():
    out = last_json_line(run_python(CHILD, timeout=240).stdout)
    assert out["moved"] > 0.05, out
    # Live v with nothing lost is Adam on the summed gradient; the frozen v is not.
    assert out["live_v"] < 1e-5, out
    assert out["live_w"] < 1e-4 * out["moved"], out  # float32 rounding of the sums
    assert out["frozen_w"] > 1e-3 * out["moved"], out
    # Frozen between refreshes; the refresh takes the exact summed gradient, weighted as
    # the EVERY steps since v last moved.
    assert out["frozen_between"] == 0.0, out
    assert out["refresh_v_moved"] > 1e-3, out
    assert out["refresh_v"] < 1e-4, out  # float32: 1 − β₂ᴷ is ~4e-3
    # Residuals were held (rank 1 of rank-2 gradients) and rescaled with the denominator.
    assert out["residual_held"] > 1e-3, out
    assert out["residual"] < 1e-5, out


def test_bad_variance_settings_are_refused_in_one_line():
    import pytest
    from tfpar.compression import PowerSGDAggregator, TopKAggregator
    for kwargs, match in (({"adam_variance": "warm"}, "adam_variance='warm' is invalid"),
                          ({"adam_refresh_every": -1}, "adam_refresh_every=-1 is invalid"),
                          ({"adam_refresh_every": 2.5}, "adam_refresh_every=2.5 is invalid"),
                          ({"adam_warmup_steps": True}, "adam_warmup_steps=True is invalid")):
        with pytest.raises(ValueError, match=match):
            PowerSGDAggregator(4, adam=(0.9, 0.999, 1e-7), **kwargs)
    # A live v needs the gradient compressed; top-k compresses each replica's Adam step.
    with pytest.raises(ValueError, match="'live' is invalid for TopKAggregator"):
        TopKAggregator(0.1, adam=(0.9, 0.999, 1e-7), adam_variance="live")
    assert PowerSGDAggregator(4, adam_variance="live").adam_variance == "live"
