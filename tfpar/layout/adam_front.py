"""Adam in front of the mesh's codecs: `AdamFrontReduction`, tf.distribute's 1-bit-Adam-style
step (`tfpar.compression.adam_front`) on the mesh's `batch` axis.

Behind Keras's Adam a lossy codec compresses the gradient and Adam normalises what error
feedback delivers late, in spikes, which slows every entry it holds back
(`Aggregator._adam_updates` says why); the quality suite's transformer ended above fp32's
band so (docs/benchmarks/compression_log.md). Here, as on tf.distribute:

- the first `adam_warmup_steps` steps are exact: the fp32 mean over `batch` and Adam on it,
  the moments the same on every replica;
- then each replica's message is its Adam step (top-k: `adam_compresses = "step"`) or its
  gradient over Adam's denominator (PowerSGD, lowbit: "gradient"), with error feedback
  around the codec, and `v` frozen (1-bit Adam) or each replica's own (`local`,
  `local_debiased`: the defaults of PowerSGD, lowbit and top-k at ratio >= 1 − β₁, as
  `tfpar.compression.make_aggregator` picks them);
- the reduction hands the optimizer the mean of the steps, which it applies linearly
  (`tfpar.layout.optimizer.applies_steps`: `w -= lr · step`); Keras's Adam slots stay zero.

The element-wise maths is `tfpar.compression.adam_front`'s functions, over every replica's
row at once. State, each piece sharded like its gradient: `adam_m`, `adam_v` per weight,
`[replicas, *shape]` laid out `(batch, *the weight's layout)` where replicas hold their own
(a replica's own momentum, its own or raised `v`), else the weight's own layout (the same
on every replica); the step counter (`step`, under the first weight's path). `tfpar.state`
saves them under `codec/<path>/<kind>` as tf.distribute's aggregator does (the moments as
one row per replica), so a checkpoint resumes across the two backends.

With fp16 loss scaling an overflowing step leaves the moments, the counter and the
residuals as they were (`BatchAxisReduction.mean`'s `kept_if`); with accumulation the
micro-batches' mean gradient enters once a step. Bytes: `comm_stats` gives the codec's,
what a compressed step sends; a warm-up step sends fp32 once, the gradient's mean.

Where replicas keep their own moments (rows), the warm-up's rows are all alike, but DTensor
takes identical rows to the weight's own layout only by a mean over `batch`: a second fp32
all-reduce each step. So the warm-up also keeps those moments whole (`m_warm`, `v_warm`, in
the weight's layout: a weight-sized tensor more per device each): the exact step moves
the whole copies and writes the rows from them (a broadcast, no collective), and the first
compressed step converts the momentum by the whole `v`. Only those steps touch the copies
(read and written inside their branch, not among `step_variables`): a compressed step
neither reads nor writes them. The copies are trusted while `warm_ok` says the last step
wrote them; a load of the state (`tfpar.state` calls `state_written`) clears it, and the
next exact step then takes the rows' mean once. A save (`named_state`) leaves it.
"""

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar.compression import adam_front
from tfpar.config import ADAM_FRONT_CODECS, TOPK_MOMENTUM_CARRY
from tfpar.layout import values
from tfpar.layout.optimizer import applies_steps
from tfpar.layout.reduction import BatchAxisReduction, kept_if

# The codecs Adam goes in front of (tf.distribute's `ADAM_STEP_AGGREGATORS`).
CODECS = ADAM_FRONT_CODECS
VARIANCES = ("frozen", "local", "local_debiased")



class AdamFrontReduction(BatchAxisReduction):
    """`BatchAxisReduction` of `codec` with Adam in front of it (module docstring).

    Args:
        mesh, variables, codec, error_feedback: as `BatchAxisReduction`'s (`codec` one of
            `CODECS`).
        optimizer: the run's `keras.optimizers.Adam` (or a `LossScaleOptimizer` of one):
            its betas and epsilon are read, and it is switched to apply the steps.
        adam_warmup_steps: exact steps first (>= 1).
        adam_variance: one of `VARIANCES`, or None for `tfpar.compression.adam_front.default_variance`.
        topk_momentum_carry: with top-k's synced momentum, the share of its continuation
            applied outside the codec (`TopKAggregator`'s `adam_momentum_carry`).
        **options: the codec's parameters, as `BatchAxisReduction` takes them.

    Raises:
        ValueError: a codec, variance or warm-up it does not run, or an optimizer that is
            not Adam without amsgrad.
    """

    def __init__(self, mesh, variables, codec, error_feedback=True, optimizer=None,
                 adam_warmup_steps=50, adam_variance=None,
                 topk_momentum_carry=TOPK_MOMENTUM_CARRY, **options):
        super().__init__(mesh, variables, codec, error_feedback, **options)
        import keras
        adam = getattr(optimizer, "inner_optimizer", optimizer)
        if codec not in CODECS:
            raise ValueError(f"codec={codec!r} is invalid with Adam in front: use one of "
                             f"{', '.join(CODECS)}")
        if not isinstance(adam, keras.optimizers.Adam) or adam.amsgrad:
            raise ValueError(f"optimizer={optimizer!r} is invalid with Adam in front of the "
                             "codec: need keras.optimizers.Adam without amsgrad")
        if int(adam_warmup_steps) < 1:
            raise ValueError(f"adam_warmup_steps={adam_warmup_steps!r} is invalid on a mesh: "
                             "Adam in front starts from >= 1 exact step")
        self.beta_1, self.beta_2, self.eps = (float(adam.beta_1), float(adam.beta_2),
                                              float(adam.epsilon))
        self.warm = int(adam_warmup_steps)
        variance = adam_variance or adam_front.default_variance(codec, self.topk.ratio,
                                                                self.beta_1)
        self.compresses = "step" if codec == "topk" else "gradient"
        # Every replica's momentum the same after each step: taken of the sum, or synced.
        self.synced = self.compresses == "gradient" or self.topk.ratio >= 1 - self.beta_1
        if variance not in VARIANCES or (variance != "frozen" and not self.synced):
            raise ValueError(f"adam_variance={variance!r} is invalid here: use "
                             + ("'frozen' (top-k below ratio 1 - beta_1 keeps each replica's "
                                "own momentum)" if not self.synced else
                                ", ".join(repr(v) for v in VARIANCES)))
        self.variance = variance
        self.local = variance != "frozen"
        self.raised = not self.synced  # `AdamFrontStep.raised_v`: frozen, unsynced top-k
        self.carry = (float(topk_momentum_carry)
                      if self.compresses == "step" and self.synced else 0.0)
        self.m_rows, self.v_rows = not self.synced, self.local or self.raised
        applies_steps(adam)
        replicated = dtensor.Layout.replicated(mesh.backend_mesh, 0)
        self.count = dtensor.DVariable(values.to_mesh(tf.constant(0, tf.int64), replicated),
                                       trainable=False)
        n = len(self.shapes)
        self.m = [self._zeros(i, self.m_rows) for i in range(n)]
        self.v = [self._zeros(i, self.v_rows) for i in range(n)]
        # The warm-up's moments whole where the state keeps rows (module docstring).
        self.m_warm = [self._zeros(i, False) for i in range(n)] if self.m_rows else []
        self.v_warm = [self._zeros(i, False) for i in range(n)] if self.v_rows else []
        self.warm_ok = dtensor.DVariable(
            values.to_mesh(tf.constant(1, tf.int64), replicated), trainable=False)

    def _zeros(self, i, rows):
        shape = ((self.replicas,) if rows else ()) + self.shapes[i]
        layout = self.stacked[i] if rows else self.own[i]
        return dtensor.DVariable(values.to_mesh(tf.zeros(shape, tf.float32), layout),
                                 trainable=False)

    @property
    def variables(self):
        """The residuals, PowerSGD's `Q`s, the step counter, every `m`, every `v`,
        `warm_ok`, the warm-up's whole copies of the rows (`m_warm`, `v_warm`)."""
        return self.step_variables + self.m_warm + self.v_warm

    @property
    def step_variables(self):
        """`variables` but the warm-up's whole copies, which only an exact step (and the
        first compressed one) reads and writes, inside its branch (module docstring)."""
        return super().variables + [self.count] + self.m + self.v + [self.warm_ok]

    def state_written(self):
        """Called by whoever wrote this reduction's state from outside (a load,
        `tfpar.state`): the warm-up's whole copies no longer match the rows, and the next
        exact step takes the rows' mean once (module docstring)."""
        if self.m_warm or self.v_warm:
            values.assign(self.warm_ok, 0)

    def named_state(self):
        """`BatchAxisReduction.named_state` and `<first weight's path>/step`,
        `<path>/adam_m`, `<path>/adam_v`: `"mean_rows"` (one row per replica) or
        `"mean_whole"` (the same on every replica), saved as rows either way; onto
        another replica count every replica takes their mean (`tfpar.state`, which calls
        `state_written` after writing any of them)."""
        out = super().named_state()
        out[f"{self.paths[0]}/step"] = (self.count, False)
        for path, m, v in zip(self.paths, self.m, self.v):
            out[f"{path}/adam_m"] = (m, "mean_rows" if self.m_rows else "mean_whole")
            out[f"{path}/adam_v"] = (v, "mean_rows" if self.v_rows else "mean_whole")
        return out

    def comm_stats(self):
        """`BatchAxisReduction.comm_stats` as of the last step: the codec's bytes after the
        warm-up; on a warm-up step fp32's (the gradient's mean, once: module docstring).
        Before any step, the codec's."""
        stats = super().comm_stats()
        if 0 < int(values.to_host(self.count)) <= self.warm:
            raw = stats["bytes_uncompressed_per_step"]
            stats.update(bytes_on_wire_per_step=raw, compression_ratio=1.0)
        return stats

    # ---- the step, through `BatchAxisReduction.mean`'s hooks -----------------------------
    def _begin(self, state):
        nq, n = len(self.qs), len(self.shapes)
        step = BatchAxisReduction._begin(self, state[:nq])
        count, rest = state[nq], iter(state[nq + 1:])
        t = tf.cast(count + 1, tf.float32)
        for kind in ("m", "v"):
            step[kind], step["new_" + kind] = [next(rest) for _ in range(n)], {}
        step["warm_ok_value"] = next(rest)
        step.update(count=count, t=t, c1=1 - tf.pow(self.beta_1, t), exact=count < self.warm,
                    first=tf.equal(count, self.warm),
                    warm_ok=tf.equal(step["warm_ok_value"], 1))
        return step

    def _end(self, step, finite):
        count = step["count"]
        out = BatchAxisReduction._end(self, step, finite) + [kept_if(finite, count + 1, count)]
        for kind in ("m", "v"):
            out += [kept_if(finite, step["new_" + kind][i], old)
                    for i, old in enumerate(step[kind])]
        # The whole copies are trusted after an exact step (which wrote them) only.
        ok = step["warm_ok_value"]
        return out + [kept_if(finite, tf.cast(step["exact"], ok.dtype), ok)]

    def _mean_one(self, i, x, residual, step):
        """The exact warm-up or the compressed step, one `tf.cond` per gradient (only the
        taken branch's collectives run)."""
        out = tf.cond(step["exact"], lambda: self._exact(i, x, residual, step),
                      lambda: self._compressed(i, x, residual, step))
        out = list(out)
        mean = out.pop(0)
        new_residual = out.pop(0) if residual is not None else None
        step["new_m"][i], step["new_v"][i] = out.pop(0), out.pop(0)
        if i in self.qs:
            step["new_qs"][i] = out.pop(0)
        return mean, new_residual

    def _out(self, i, mean, residual, m, v, q):
        """A branch's outputs, each in its layout (both branches of the `tf.cond` alike)."""
        out = [dtensor.relayout(mean, self.own[i])]
        if residual is not None:
            out.append(dtensor.relayout(residual, self.stacked[i]))
        out.append(dtensor.relayout(m, self.stacked[i] if self.m_rows else self.own[i]))
        out.append(dtensor.relayout(v, self.stacked[i] if self.v_rows else self.own[i]))
        if i in self.qs:
            out.append(dtensor.relayout(q, self._replicated(2)))
        return tuple(out)

    def _whole(self, i, rows):
        """Identical rows `[replicas, *shape]` as one tensor in the weight's layout (their
        mean: an fp32 all-reduce over `batch`)."""
        return dtensor.relayout(tf.reduce_sum(rows, 0), self.own[i]) / self.replicas

    def _as_rows(self, i, whole):
        """A whole tensor as every replica's row `[replicas, *shape]`, each device keeping
        its own row of the broadcast (no collective)."""
        rows = (self.replicas,) + self.shapes[i]
        return dtensor.relayout(tf.broadcast_to(whole, rows), self.stacked[i])

    def _warm_moment(self, i, kind, step):
        """Moment `kind` ("m" or "v") of gradient `i` before an exact step, whole: the
        state itself, or for rows their whole copy (the rows' mean when not trusted), read
        here, in the exact step's branch."""
        copies = getattr(self, f"{kind}_warm")
        if not copies:
            return step[kind][i]
        return tf.cond(step["warm_ok"],
                       lambda: dtensor.relayout(copies[i].read_value(), self.own[i]),
                       lambda: self._whole(i, step[kind][i]))

    def _write_warm(self, i, m, v, step):
        """The exact step's whole `m`, `v` of gradient `i` into the warm-up's copies (kept
        on a skipped step), inside the exact step's branch: the ops of the writes."""
        writes = []
        for copies, value in ((self.m_warm, m), (self.v_warm, v)):
            if copies:
                old = copies[i].read_value()
                new = dtensor.relayout(kept_if(step["finite"], value, old), self.own[i])
                writes.append(copies[i].assign(new))
        return writes

    def _exact(self, i, x, residual, step):
        """The fp32 mean over `batch` and Keras's Adam on it (`AdamFrontStep.exact`): one
        all-reduce; the moments moved whole, written to rows where the state keeps rows."""
        g = dtensor.relayout(tf.reduce_sum(x, 0), self.own[i]) / self.replicas
        m = adam_front.moved(self._warm_moment(i, "m", step), g, 1 - self.beta_1)
        v = adam_front.moved(self._warm_moment(i, "v", step), tf.square(g), 1 - self.beta_2)
        c2 = 1 - tf.pow(self.beta_2, step["t"])
        update = adam_front.exact_step(m, v, step["c1"], c2, self.eps)
        with tf.control_dependencies(self._write_warm(i, m, v, step)):
            return self._out(i, update, residual, self._as_rows(i, m) if self.m_rows else m,
                             self._as_rows(i, v) if self.v_rows else v, step["qs"].get(i))

    def _codec(self, i, message, residual, step):
        """`(mean, next residual, next Q)` of the replicas' `message`s through the codec."""
        inner = {"qs": step["qs"], "new_qs": {}}
        mean, new_residual = BatchAxisReduction._mean_one(self, i, message, residual, inner)
        return mean, new_residual, inner["new_qs"].get(i)

    def _compressed(self, i, x, residual, step):
        """A compressed step (`AdamFrontStep.compressed`'s branches, rows at once)."""
        m, v, c1 = step["m"][i], step["v"][i], step["c1"]
        beta_1 = self.beta_1
        c2 = 1 - self.beta_2 ** self.warm  # frozen `v`'s bias correction
        kept, v_new = 0.0, v
        if self.local:
            s_old, s, v_new = self._move_local(i, x, m, v, step)
            mu = self._scaled_momentum(i, m, s_old, step)
        elif self.compresses == "step":
            v_new = adam_front.raised_variance(v, x, self.beta_2) if self.raised else v
            s = adam_front.denominator(v_new, c2, self.eps)
        else:
            s = adam_front.denominator(v, c2, self.eps)
        if self.compresses == "step" and self.local:
            message, kept = adam_front.synced_message(mu, x, s, beta_1, c1, self.carry)
        elif self.compresses == "step":
            m_rows = adam_front.moved(m, x, 1 - beta_1)
            message, kept = adam_front.frozen_message(m_rows, c1, s, m, beta_1, self.carry)
        else:
            message = x / s
        mean, new_residual, q = self._codec(i, message, residual, step)
        if self.compresses == "step":
            mean = mean + kept
            # Synced: every replica's momentum is the one the mean step applied.
            m_new = (mean * c1 * (1.0 if self.local else s) if self.synced else m_rows)
            return self._out(i, mean, new_residual, m_new, v_new, q)
        if self.local:
            m_new = adam_front.moved(mu, mean, 1 - beta_1)  # in the scaled units
            return self._out(i, m_new / c1, new_residual, m_new, v_new, q)
        m_new = adam_front.moved(m, mean * s, 1 - beta_1)
        return self._out(i, m_new / c1 / s, new_residual, m_new, v_new, q)

    def _move_local(self, i, x, m, v, step):
        """Each replica's own `v` moved by its own gradient (`AdamFrontStep.move_local_v`):
        `(denominator before, after, v after)`, rows."""
        t, replicas = step["t"], self.replicas
        s_old = adam_front.denominator(v, 1 - tf.pow(self.beta_2, t - 1), self.eps)
        g_hat = None
        if self.variance == "local_debiased":
            # The mean gradient's estimate: m / c1 in the gradient's units on the first
            # compressed step (m still the warm-up's), m · s_i / c1 after.
            rows = (self.replicas,) + self.shapes[i]
            g_hat = tf.cond(
                step["first"],
                lambda: dtensor.relayout(tf.broadcast_to(m, rows), self.stacked[i]),
                lambda: dtensor.relayout(m * s_old, self.stacked[i]))
            g_hat = g_hat / (1 - tf.pow(self.beta_1, t - 1))
        square = adam_front.own_square(x, replicas, g_hat)
        v_new = adam_front.moved(v, square, 1 - self.beta_2)
        s_new = adam_front.denominator(v_new, 1 - tf.pow(self.beta_2, t), self.eps)
        return s_old, s_new, v_new

    def _scaled_momentum(self, i, m, s_old, step):
        """The synced momentum in the scaled units (`m / s`): converted once, on the first
        compressed step, by the warm-up's `v` (the same on every replica: its whole copy,
        or the rows' mean when that is not trusted)."""
        def converted():
            c2 = 1 - tf.pow(self.beta_2, step["t"] - 1)
            s_whole = adam_front.denominator(self.v_warm[i].read_value(), c2, self.eps)
            return tf.cond(step["warm_ok"],
                           lambda: dtensor.relayout(m / s_whole, self.own[i]),
                           lambda: self._whole(i, m / s_old))
        return tf.cond(step["first"], converted, lambda: dtensor.relayout(m, self.own[i]))
