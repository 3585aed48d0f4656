"""Adam in front of compression: one step of `Aggregator(adam_warmup_steps=K)`.

1-bit Adam (Tang et al. 2021): for the first K steps the gradients are all-reduced exactly
(fp32) and every replica runs Keras's Adam on the sum, so the moments are the global ones,
identical everywhere. From then on Adam's second moment `v` follows `adam_variance`:

- `frozen`: `v` (and its bias correction) stays fixed; each replica moves its momentum
  with its own gradient and compresses its step `m̂ / (√v̂ + ε) / replicas` with error
  feedback. With `v` the same on every replica that step is linear in the gradient, so
  the summed steps are exactly Adam's (with `v` frozen) on the global gradient, only
  delayed by what error feedback holds back. With `adam_sync_momentum` every replica then
  sets its momentum to the one the summed step applied (`Σ sent · c1 · s`), so an entry
  still waiting in a residual has no momentum pushing it further meanwhile.
- `live`: `v` moves every step with the summed gradient compression delivered.
- `local` / `local_debiased`: each replica moves its own `v` with its own exact gradient.

`adam_refresh_every=E` runs an exact step every E steps after the warm-up (`v` refreshed).
`AdamFrontStep(aggregator, positions).run(grads)` returns `(summed steps, wire bytes)`.
"""

import math

import tensorflow as tf

from tfpar.compression import buckets, collectives

LOCAL_VARIANCE = ("local", "local_debiased")


def default_variance(codec, topk_ratio, beta_1):
    """How `v` moves after the warm-up by default, as `tfpar.compression.make_aggregator`
    picks it: each replica's own, debiased, except top-k below ratio 1 − β₁ (its momentum
    is not synced there: `v` frozen, and raised per replica)."""
    if codec == "topk" and topk_ratio < 1 - beta_1:
        return "frozen"
    return "local_debiased"


# The element-wise rules, one home for both backends: tf.distribute's `AdamFrontStep` below
# (one replica's tensors; Keras divided its gradient by the replicas) and the mesh's
# `tfpar.layout.adam_front` (every replica's row at once, `[replicas, *shape]`). `g` is
# always a replica's own gradient (its batch's mean), a message is in those units and
# the step applies the replicas' mean of the messages.
def denominator(v, c2, eps):
    """Adam's denominator √v̂ + ε with v̂ = v / c2: a step is (m / c1) / denominator."""
    return (tf.sqrt(v) + eps * tf.sqrt(c2)) / tf.sqrt(c2)


def moved(x, target, rate):
    """An Adam moving average: `x + (target − x) · rate` (rate 1 − β)."""
    return x + (target - x) * rate


def exact_step(m, v, c1, c2, eps):
    """Keras's Adam step of moments `m`, `v` (ε added to the uncorrected √v)."""
    return m * (tf.sqrt(c2) / c1) / (tf.sqrt(v) + eps)


def raised_variance(v, g, beta_2):
    """A frozen `v` raised where it is below `(1 − β₂) · g²` of a replica's own gradient `g`
    (`AdamFrontStep.raised_v` says why)."""
    return tf.maximum(v, (1 - beta_2) * tf.square(g))


def own_square(g, replicas, g_hat=None):
    """What a replica's own `v` averages: `g²` of its own gradient, or debiased with `ĝ`
    (the momentum's estimate of the replicas' mean gradient) `g² / replicas + (1 − 1 /
    replicas) · ĝ²`: a replica's gradient carries `replicas` × the mean's noise."""
    if g_hat is None:
        return tf.square(g)
    return tf.square(g) / replicas + (1 - 1 / replicas) * tf.square(g_hat)


def frozen_message(m, c1, s, m_old=None, beta_1=0.0, carry=0.0):
    """A replica's Adam step over the shared denominator `s`, `m / c1 / s`, and the part
    of it every replica applies alike without sending it (`carry · β₁ · m_old / c1 / s`,
    the synced momentum's continuation; 0 without a carry): `(message, kept)`."""
    step = m / c1 / s
    if not carry:
        return step, 0.0
    kept = carry * beta_1 * m_old / c1 / s
    return step - kept, kept


def synced_message(mu, g, s, beta_1, c1, carry=0.0):
    """With the momentum synced in the scaled units (`mu`, the same on every replica) and
    each replica's own denominator `s`: `((β₁ μ + (1 − β₁) g / s) / c1 − kept, kept)`,
    `kept = carry · β₁ · μ / c1` applied alike without being sent."""
    step = (mu * beta_1 + g / s * (1 - beta_1)) / c1
    if not carry:
        return step, 0.0
    kept = carry * beta_1 * mu / c1
    return step - kept, kept


class AdamFrontStep:
    """One step's constants and the branches of Adam in front of `aggregator`'s exchange.

    Args:
        aggregator: the `Aggregator` (its `adam`, `moments`, `residuals`, step counter and
            `_compress_and_exchange`).
        positions: the positions of this step's gradients among the model's variables.
    """

    def __init__(self, aggregator, positions):
        agg = self.agg = aggregator
        self.positions = positions
        self.beta_1, self.beta_2, self.eps = agg.adam
        self.replicas = collectives.replica_context().num_replicas_in_sync
        self.warm, self.every = agg.adam_warmup_steps, agg.adam_refresh_every
        self.live = agg.adam_variance == "live"
        self.own = agg.adam_variance in LOCAL_VARIANCE
        self.debias = agg.adam_variance == "local_debiased"
        self.rescale = agg.adam_compresses == "gradient" and bool(self.live or self.every)
        self.t = tf.cast(agg.step + 1, tf.float32)
        self.c1 = 1 - tf.pow(self.beta_1, self.t)
        self.t_v = self._steps_v_stood_for()
        self.first = tf.equal(agg.step, self.warm)  # m still holds the exact sum's momentum

    def _steps_v_stood_for(self):
        """Steps `v` stood for before this step: every step while it moves, else the
        warm-up plus the refreshes so far (a refresh is step warm + j·every − 1, 0-based)."""
        if self.live or self.own:
            return self.t - 1
        if self.every:
            step, warm = self.agg.step, self.warm
            return tf.where(step < warm, self.t - 1, tf.cast(
                warm + self.every * ((tf.maximum(step, warm) - warm) // self.every),
                tf.float32))
        return tf.constant(float(self.warm))

    def scale(self, v, c2):
        return denominator(v, c2, self.eps)

    def moment(self, kind, position):
        return self.agg.moments[f"{kind}_{position}"]

    def run(self, grads):
        """The summed steps and the wire bytes: exact on warm-up and refresh steps."""
        gs = [tf.convert_to_tensor(g) for g in grads]  # embeddings' IndexedSlices dense
        is_exact = self.agg.step < self.warm
        if self.every:
            is_exact = tf.logical_or(
                is_exact, tf.equal((self.agg.step - self.warm + 1) % self.every, 0))
        return collectives.replica_cond(is_exact, self.exact, self.compressed, (gs,))

    def exact(self, gs):
        """fp32 all-reduce of the gradients, Keras's Adam on the sum (moments global)."""
        agg, beta_1, beta_2, t = self.agg, self.beta_1, self.beta_2, self.t
        plan = buckets.plan_buckets([g.shape for g in gs], agg.bucket_bytes)
        sums, nbytes = [None] * len(gs), 0
        for bucket in plan:
            total, b = collectives.sum_all(buckets.pack(gs, bucket), agg.collective_options)
            for j, part in buckets.unpack(total, bucket).items():
                sums[j] = part
            nbytes += b
        c2 = 1 - tf.pow(beta_2, t)
        # A refresh after a frozen stretch weighs the exact gradient as the steps since
        # `v` last moved; in the warm-up (and with a live `v`) that is one step.
        if self.every and not self.live:
            log_decay = (t - self.t_v) * math.log(beta_2)
            gain = -tf.math.expm1(log_decay)  # 1 − β₂ᴷ without cancellation
        else:
            gain = 1 - beta_2
        c2_before = 1 - tf.pow(beta_2, tf.maximum(self.t_v, 1.0))
        out = []
        for g, p in zip(sums, self.positions):
            m, v = self.moment("m", p), self.moment("v", p)
            m_new = moved(m, g, 1 - beta_1)
            v_new = moved(v, tf.square(g), gain)
            if self.rescale and str(p) in agg.residuals:
                agg.rescale_residual(p, self.scale(v, c2_before), self.scale(v_new, c2))
            m.assign(m_new)
            v.assign(v_new)
            out.append(exact_step(m_new, v_new, self.c1, c2, self.eps))
        if agg.observes_exact and agg.adam_compresses == "gradient":
            # What compression will carry: the summed gradient over Adam's denominator.
            agg.on_exact_step([g / self.scale(self.moment("v", p), c2)
                                for g, p in zip(sums, self.positions)], self.positions)
        return out, tf.cast(nbytes, tf.int64)

    def compressed(self, gs):
        """A compressed step, by what is compressed (`adam_compresses`) and `v`'s rule."""
        c2 = 1 - tf.pow(self.beta_2, self.t_v)  # v's bias correction when it last moved
        if self.own and self.agg.adam_compresses == "step":
            return self.local_variance_step(gs)
        if (self.agg.adam_compresses == "step" and not self.agg.adam_sync_momentum
                and self.agg.lossy):
            scales = [self.scale(self.raised_v(g, p), c2) for g, p in zip(gs, self.positions)]
            return self.frozen_variance_step(gs, scales)
        scales = [self.scale(self.moment("v", p), c2) for p in self.positions]
        if self.agg.adam_compresses == "step":
            return self.frozen_variance_step(gs, scales)
        if self.own:
            return self.local_variance(gs)
        return self.compressed_gradient(gs, scales, c2)

    def raised_v(self, g, p):
        """This replica's frozen `v`, raised where it is below `(1 − β₂) · g²` for its own
        gradient `g · replicas`: the least Keras's Adam's own `v` holds after any step.

        A frozen `v` knows only the warm-up's gradients. An entry whose gradient was zero or
        tiny then (an embedding row nobody looked up: `v` = 0) had its step `m̂ / (√v̂ + ε)`
        divided by ~ε once its gradient came, 10⁶× Adam's, and the weights ran to NaN
        (docs/guides/compression.md). Raised, the step stays within Adam's own bound; an
        entry the warm-up saw at its usual size is left as it was (it would need a gradient
        ~7× the warm-up's RMS). Each replica raises its own `v` (no bytes), so only where
        every replica's momentum is its own (top-k below `1 − β₁`, `adam_sync_momentum`
        off): a synced momentum needs `v` the same everywhere. The exact aggregator with
        Adam in front (no user's path takes it) stays frozen-`v` Adam itself, the reference
        the tests compare compressed runs with."""
        v = self.moment("v", p)
        raised = raised_variance(v, g * self.replicas, self.beta_2)
        v.assign(raised)
        return raised

    def frozen_variance_step(self, gs, scales):
        """Each replica compresses its own Adam step over the shared (frozen) `v`."""
        agg, beta_1, c1, replicas = self.agg, self.beta_1, self.c1, self.replicas
        carry = agg.adam_momentum_carry if agg.adam_sync_momentum else 0.0
        steps, kept = [], []
        for g, s, p in zip(gs, scales, self.positions):
            m = self.moment("m", p)
            m_old = m.read_value()
            # This replica's own gradient is g · replicas; its share of the sum is g.
            m_new = moved(m_old, g * replicas, 1 - beta_1)
            m.assign(m_new)
            # The synced momentum's own continuation (the same on every replica) is
            # applied whether or not its entry is sent; only the rest is compressed.
            step, k = frozen_message(m_new, c1, s, m_old, beta_1, carry)
            kept.append(k)
            steps.append(step / replicas)
        summed, nbytes = agg._compress_and_exchange(steps, self.positions)
        if carry:
            summed = [u + k for u, k in zip(summed, kept)]
        if agg.adam_sync_momentum:
            # Exact when nothing is dropped: Σ sent = mean of the replicas' m / c1 / s.
            for u, s, p in zip(summed, scales, self.positions):
                self.moment("m", p).assign(u * c1 * s)
        return list(summed), tf.cast(nbytes, tf.int64)

    def compressed_gradient(self, gs, scales, c2):
        """The gradient scaled by Adam's denominator is compressed and summed, and the
        momentum (and a live `v`) taken of the sum, identical on every replica."""
        agg, beta_1, beta_2 = self.agg, self.beta_1, self.beta_2
        summed, nbytes = agg._compress_and_exchange(
            [g / s for g, s in zip(gs, scales)], self.positions)
        c2_now = 1 - tf.pow(beta_2, self.t) if self.live else c2
        out = []
        for u, s, p in zip(summed, scales, self.positions):
            m = self.moment("m", p)
            g_sum = u * s
            m_new = moved(m, g_sum, 1 - beta_1)
            m.assign(m_new)
            if self.live:
                v = self.moment("v", p)
                v_new = moved(v, tf.square(g_sum), 1 - beta_2)
                v.assign(v_new)
                s_new = self.scale(v_new, c2_now)
                if str(p) in agg.residuals:
                    agg.rescale_residual(p, s, s_new)
                s = s_new
            out.append(m_new / self.c1 / s)
        return out, tf.cast(nbytes, tf.int64)

    def move_local_v(self, g, p):
        """This replica's own v moved by its own gradient (g · replicas, exact): returns
        the denominators before and after."""
        beta_1, beta_2, t, replicas = self.beta_1, self.beta_2, self.t, self.replicas
        c2 = 1 - tf.pow(beta_2, self.t_v)  # v last moved on the previous step
        c2_now = 1 - tf.pow(beta_2, t)
        c1_before = 1 - tf.pow(beta_1, t - 1)
        v = self.moment("v", p)
        s_old = self.scale(v, c2)
        if self.debias:
            m = self.moment("m", p)
            # The summed gradient's estimate in its own units: m / c1 · s_i (a cond, not
            # a `where`: no extra pass over m on every later step).
            g_hat = tf.cond(self.first, lambda: m.read_value(),
                            lambda: m * s_old) / c1_before
            square = own_square(g * replicas, replicas, g_hat)
        else:
            square = own_square(g * replicas, replicas)
        v_new = moved(v, square, 1 - beta_2)
        v.assign(v_new)
        return s_old, self.scale(v_new, c2_now)

    def scaled_momentum(self, p, s_old):
        """The momentum in the scaled units (m / s, the same on every replica); converted
        once, by the warm-up's v (still the same everywhere)."""
        m = self.moment("m", p)
        return tf.cond(self.first, lambda: m / s_old, lambda: m.read_value())

    def local_variance_step(self, gs):
        """Top-k with each replica's own v: the synced momentum is kept in the scaled units
        (μ, the same everywhere) and a replica's step is (β₁ μ / replicas + (1 − β₁) g /
        s_i) / c1, so the steps sum to the momentum of Σ_i g_i / s_i over c1, as
        `local_variance`; each replica compresses its own."""
        beta_1, c1, replicas = self.beta_1, self.c1, self.replicas
        carry = self.agg.adam_momentum_carry
        steps, kept = [], []
        for g, p in zip(gs, self.positions):
            s_old, s_new = self.move_local_v(g, p)
            mu = self.scaled_momentum(p, s_old)
            step, k = synced_message(mu, g * replicas, s_new, beta_1, c1, carry)
            kept.append(k)
            steps.append(step / replicas)
        summed, nbytes = self.agg._compress_and_exchange(steps, self.positions)
        if carry:
            summed = [u + k for u, k in zip(summed, kept)]
        for u, p in zip(summed, self.positions):
            self.moment("m", p).assign(u * c1)
        return list(summed), tf.cast(nbytes, tf.int64)

    def local_variance(self, gs):
        """Each replica moves its own v with its own gradient (g · replicas, exact) and
        sends g / s_i; the momentum is of the sum Σ_i g_i / s_i, the same everywhere.

        The residuals are not rescaled: only their sum over replicas is ever sent (PowerSGD
        is linear in the summed matrix), and each also holds its replica's deviation from
        the replicas' mean (DDP's residual), which cancels in that sum. Rescaled by each
        replica's own s_old / s_new they would no longer cancel
        (tests/adam_front_child.py's `powersgd_local_variance`); unrescaled, the debt is
        kept exactly in the units the momentum sums."""
        xs, olds = [], []
        for g, p in zip(gs, self.positions):
            s_old, s_new = self.move_local_v(g, p)
            xs.append(g / s_new)
            olds.append(s_old)
        summed, nbytes = self.agg._compress_and_exchange(xs, self.positions)
        out = []
        for u, s_old, p in zip(summed, olds, self.positions):
            m_old = self.scaled_momentum(p, s_old)
            m_new = moved(m_old, u, 1 - self.beta_1)
            self.moment("m", p).assign(m_new)
            out.append(m_new / self.c1)
        return out, tf.cast(nbytes, tf.int64)


# ---- State conversion (checkpoints: `tfpar.state`) ----------------------------------------
# Keras 3's Adam (3.15.1 `Adam.update_step`) keeps m and v of the summed gradient, both
# bias-corrected at its `iterations` t: m̂ = m / (1 − β₁ᵗ), v̂ = v / (1 − β₂ᵗ). In front
# of a codec the moments hold the same through the exact warm-up; then a replica's own `v`
# ("local", "local_debiased") turns m into Adam's scaled units (m / (√v̂ + ε), converted
# once by `AdamFrontStep.scaled_momentum`), and a frozen `v` keeps the bias correction of
# the steps it stood for (`AdamFrontStep._steps_v_stood_for`). Rows are replicas' own
# values (a replica's momentum, its own `v`); Keras's slot is their mean.
def moment_units(variance, warmup_steps, refresh_every, steps, adam):
    """What Adam in front's moments hold after `steps` steps: a JSON-able dict (a
    checkpoint's `meta/adam_moments` record).

    Args:
        variance: `v`'s rule after the warm-up ("frozen", "live", "local", ...).
        warmup_steps, refresh_every: the exact warm-up's length (0: none), the refresh
            period (0: none).
        steps: steps the front has taken (its `step` counter).
        adam: `(beta_1, beta_2, epsilon)`.

    Returns:
        `{"m": "gradient" | "scaled", "v_steps": n, "steps": steps, "beta_1", "beta_2",
        "epsilon"}`: `m` in the gradient's units or scaled by Adam's denominator; `v` in
        the squared gradient's, bias-corrected as `v / (1 − β₂ⁿ)`.
    """
    # No warm-up: every replica's own Adam of its own gradient (`Aggregator._adam_updates`).
    local = variance in LOCAL_VARIANCE and warmup_steps > 0
    if steps < warmup_steps or local or variance == "live" or not warmup_steps:
        v_steps = steps
    elif refresh_every:
        v_steps = warmup_steps + refresh_every * ((steps - warmup_steps) // refresh_every)
    else:
        v_steps = warmup_steps
    beta_1, beta_2, eps = (float(a) for a in adam)
    return {"m": "scaled" if local and steps > warmup_steps else "gradient",
            "v_steps": int(v_steps), "steps": int(steps), "beta_1": beta_1,
            "beta_2": beta_2, "epsilon": eps}


def _correction(beta, steps):
    """1 − βⁿ, or 1 before any step (the moments are then zero)."""
    return 1 - beta ** steps if steps > 0 else 1.0


def keras_slots(m_rows, v_rows, units, iteration):
    """Keras's Adam `(momentum, velocity)` at `iteration` holding the estimates of the
    front's moments `m_rows`, `v_rows` (arrays `[rows, ...]`, in `units`, `moment_units`'s
    dict): the same v̂, and the same m̂ in the gradient's units (a scaled row times its
    own denominator, `denominator`); rows averaged."""
    b1, b2, eps = units["beta_1"], units["beta_2"], units["epsilon"]
    c2_front = _correction(b2, units["v_steps"])
    m = m_rows
    if units["m"] == "scaled":
        m = m_rows * ((v_rows / c2_front) ** 0.5 + eps)
    m = m.mean(0) * (_correction(b1, iteration) / _correction(b1, units["steps"]))
    v = v_rows.mean(0) * (_correction(b2, iteration) / c2_front)
    return m, v


def front_moments(momentum, velocity, units, iteration):
    """`keras_slots`' inverse: the front's `(m, v)` in `units` (`moment_units` for the
    running front at `steps` = `iteration`) from Keras's Adam slots at `iteration`."""
    b1, b2, eps = units["beta_1"], units["beta_2"], units["epsilon"]
    c2_front = _correction(b2, units["v_steps"])
    v = velocity * (c2_front / _correction(b2, iteration))
    m = momentum * (_correction(b1, units["steps"]) / _correction(b1, iteration))
    if units["m"] == "scaled":
        m = m / ((v / c2_front) ** 0.5 + eps)
    return m, v
