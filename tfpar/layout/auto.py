"""`--compression=auto` on the mesh: the `batch` axis's reduction (`tfpar.layout.reduction`)
with `auto`'s per-matrix PowerSGD rank, decided as `tfpar.compression.auto` decides it.

The rules are `AutoAggregator`'s, called from there (`plan`, `matrix_ranks`, `next_rank`,
`beyond_shares`, `lowest_rank`): the link's budget gives each matrix's floor rank (an
fp32 budget that fits the whole model sends everything exactly); the first `start_step`
steps average exactly, the last `window` of them running PowerSGD's subspace iteration on
the exact sum (no bytes over `batch`) to warm `Q` and pick each matrix's first rank; after
that each step sends rank-r factors, and at each window's end a matrix's rank doubles, drops or
stays by the summed gradient's energy along `Q`'s columns and its norm's change. Vectors
and matrices too small to gain go whole in fp32.

On the mesh the link is the `batch` axis's sum (timed at build as `measure_link` times an
all-reduce, the slowest client's figures) or `--auto_link_mbps`. Without the loss guard
(`LossGuard` is a Keras callback on tf.distribute's `fit`) and without Adam in front: the
optimizer, Adam too, runs after the sum, as behind every mesh codec.

DTensor propagates layouts only through static shapes, so a rank is not a dynamic slice
of `Q` as on tf.distribute: each matrix's step is a chain of `tf.cond`s, one branch per
rank it can take (1, 2, 4, … up to its largest) and one for the exact start, each with
static shapes (none below the budget's floor, which no rank goes under); only the taken
branch's collectives run.

State, every piece sharded like what it belongs to and saved by `tfpar.state` under
`codec/<path>/…`: `residual` (`[replicas, *shape]`, one row per replica), per matrix
`powersgd_q` (`[m, r_max]`, replicated: the columns beyond the current rank keep their last
values for when it grows), `auto_rank`, `auto_norm_sum`, `auto_norm_prev`,
`auto_beyond_sum` (the window's sums), and the reduction's `auto_step`, `auto_calls` and
`auto_bytes_total` under its first weight's path.
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar.compression import auto, powersgd
from tfpar.layout import values
from tfpar.layout.reduction import BatchAxisReduction, kept_if, where_scalar


class AutoReduction(BatchAxisReduction):
    """`BatchAxisReduction` whose matrices go as PowerSGD factors at `auto`'s rank.

    Args:
        mesh, variables, error_feedback: as `BatchAxisReduction`'s.
        budget_ms: wall time per step the exchange may take on the link (`--auto_budget_ms`).
        link: `(bytes_per_s, latency_s)` to decide on instead of timing the `batch` axis's
            sum (`--auto_link_mbps`, `--auto_link_latency_ms`).
        seed: seed of the initial `Q`s.
        **options: `BatchAxisReduction`'s other codec parameters (unused by `auto`).
    """

    def __init__(self, mesh, variables, error_feedback=True, budget_ms=20.0, link=None,
                 seed=0, **options):
        super().__init__(mesh, variables, "auto", error_feedback, seed=seed, **options)
        self.policy = auto.AutoAggregator(budget_ms, link, seed=seed)
        if link is None:
            self.policy.link = auto.measure_link(None, times=self._times)
        self.r_budget = self.policy.plan(self.shapes)
        self.r_max, self.r_floor = ({}, {}) if self.r_budget is None else (
            auto.AutoAggregator.matrix_ranks(self.shapes, self.r_budget))
        self.start = self.policy.start_step
        self.window = self.policy.window
        rep = self._replicated

        def scalar(value, dtype):
            return dtensor.DVariable(values.to_mesh(tf.constant(value, dtype), rep(0)),
                                     trainable=False)

        self.matrix_state = {}  # position -> {name: DVariable}
        for i, r_max in self.r_max.items():
            m = powersgd.matrix_shape(self.shapes[i])[1]
            self.matrix_state[i] = {
                "powersgd_q": dtensor.DVariable(values.to_mesh(
                    powersgd.initial_q(m, r_max, seed + i), rep(2)), trainable=False),
                "auto_rank": scalar(r_max, tf.int32),
                "auto_norm_sum": scalar(0.0, tf.float32),
                "auto_norm_prev": scalar(-1.0, tf.float32),
                "auto_beyond_sum": dtensor.DVariable(values.to_mesh(
                    tf.zeros([len(auto.levels(r_max))]), rep(1)), trainable=False)}
        # `auto_step`: steps taken (a skipped fp16 step is not: it leaves the codec as it
        # was); `auto_calls`: steps run, skipped ones too, whose collectives were sent all
        # the same (`auto_bytes_total` counts them).
        self.counters = {"auto_step": scalar(0, tf.int32), "auto_calls": scalar(0, tf.int32),
                         "auto_bytes_total": scalar(0, tf.int64)}

    def _times(self, small, large, repeats):
        """`measure_link`'s two timings on the mesh: sums over `batch` of `small` and of
        `large` floats per replica (`auto.fastest_in_turn`), the slowest client's (every
        client decides alike)."""
        fns = []
        for n in (small, large):
            x = values.to_mesh(np.ones([self.replicas, n], np.float32), self._rows)
            fns.append(tf.function(lambda x=x: dtensor.relayout(tf.reduce_sum(x, 0),
                                                                self._replicated(1))))
        best = auto.fastest_in_turn([lambda fn=fn: values.to_host(fn()) for fn in fns],
                                    repeats)
        return tuple(float(t) for t in self._slowest(best))

    def _slowest(self, figures):
        """`figures` (host floats) maxed over the mesh's clients: each local device holds
        its client's, the max over every device replicated."""
        mesh = self.mesh.backend_mesh
        names = list(mesh.dim_names)
        layout = dtensor.Layout(names + [dtensor.UNSHARDED], mesh)
        local = tf.reshape(tf.constant(figures, tf.float32), [1] * len(names) + [-1])
        packed = dtensor.pack([local] * len(mesh.local_device_ids()), layout)
        agreed = dtensor.relayout(tf.reduce_max(packed, list(range(len(names)))),
                                  self._replicated(1))
        return dtensor.unpack(agreed)[0].numpy()

    @property
    def variables(self):
        """The residuals, then each matrix's state (sorted by position, its names sorted),
        then the counters: the order `read()` and `mean`'s new state use."""
        out = list(self.residuals)
        for i in sorted(self.matrix_state):
            out += [self.matrix_state[i][k] for k in sorted(self.matrix_state[i])]
        return out + [self.counters[k] for k in sorted(self.counters)]

    def named_state(self):
        out = super().named_state()
        for i, state in self.matrix_state.items():
            out.update({f"{self.paths[i]}/{k}": (v, False) for k, v in state.items()})
        out.update({f"{self.paths[0]}/{k}": (v, False) for k, v in self.counters.items()})
        return out

    def ranks(self):
        """`{weight path: rank}` of each matrix now (0: before compression starts)."""
        step = int(values.to_host(self.counters["auto_step"]))
        return {self.paths[i]: (max(int(values.to_host(s["auto_rank"])), self.r_floor[i])
                                if step >= self.start else 0)
                for i, s in self.matrix_state.items()}

    def comm_stats(self):
        """Bytes one replica handed to the `batch` collectives per step, the mean over the
        steps run (the rank changes by window), skipped fp16 steps included (their
        collectives ran, on the residuals alone): fp32 on the exact start, then each
        matrix's factors at its rank and the rest in fp32; before any step, fp32's."""
        raw = 4 * sum(self.sizes)
        # (`auto_step` too: a checkpoint written before `auto_calls` existed loads it as 0.)
        steps = max(int(values.to_host(self.counters[k])) for k in ("auto_calls", "auto_step"))
        wire = (int(values.to_host(self.counters["auto_bytes_total"])) / steps
                if steps else raw)
        return {"bytes_on_wire_per_step": wire, "bytes_uncompressed_per_step": raw,
                "compression_ratio": raw / wire}

    def _begin(self, state):
        """`BatchAxisReduction.mean`'s step: each matrix's state, the counters, the step's
        phase (exact start, its planning window, compressed, a window's end)."""
        at, mats = 0, {}
        for i in sorted(self.matrix_state):
            names = sorted(self.matrix_state[i])
            mats[i] = dict(zip(names, state[at:at + len(names)]))
            at += len(names)
        counters = dict(zip(sorted(self.counters), state[at:]))
        step = counters["auto_step"]
        compressing = step >= self.start
        return {"mats": mats, "new_mats": {}, "counters": counters, "step": step,
                "compressing": compressing,
                "planning": (step >= self.start - min(self.window, self.start)) & ~compressing,
                "window_end": compressing & tf.equal((step - self.start + 1) % self.window, 0),
                "wire": tf.constant(0, tf.int64)}

    def _reduce(self, i, x, step):
        if i not in step["mats"]:  # vectors and small matrices: whole, in fp32
            step["wire"] += 4 * self.sizes[i]
            return tf.reduce_sum(x, 0), x
        total, sent, step["new_mats"][i], nbytes = self._matrix(i, x, step)
        step["wire"] += nbytes
        return total, sent

    def _end(self, step, finite):
        new, old = [], []
        for i in sorted(step["mats"]):
            new += [step["new_mats"][i][k] for k in sorted(step["mats"][i])]
            old += [step["mats"][i][k] for k in sorted(step["mats"][i])]
        # A skipped step leaves the codec's state as it was, and its step count: the
        # exact start and the windows count steps taken. What it sent is counted.
        new = [kept_if(finite, a, b) for a, b in zip(new, old)]
        counters = step["counters"]
        new_counters = {"auto_step": kept_if(finite, step["step"] + 1, step["step"]),
                        "auto_calls": counters["auto_calls"] + 1,
                        "auto_bytes_total": counters["auto_bytes_total"] + step["wire"]}
        return new + [new_counters[k] for k in sorted(self.counters)]

    def _matrix(self, i, x, phase):
        """Matrix `i`'s `(sum, each replica's sent share, new state, bytes)` this step."""
        st, step, compressing = phase["mats"][i], phase["step"], phase["compressing"]
        planning, window_end = phase["planning"], phase["window_end"]
        r_max, floor = self.r_max[i], self.r_floor[i]
        q = dtensor.relayout(st["powersgd_q"], self._replicated(2))
        rank = tf.maximum(st["auto_rank"], floor)
        shape = self.shapes[i]
        zeros_b = tf.zeros([len(auto.levels(r_max))])

        def exact():
            total = tf.reduce_sum(x, 0)
            return (dtensor.relayout(total, self.own[i]), x, q, tf.constant(0.0), zeros_b)

        def at_rank(r):
            def branch():
                total, share, q_sum = self._powersgd(x, q[:, :r])
                new_q = tf.concat([q_sum, q[:, r:]], 1) if r < r_max else q_sum
                new_q = tf.where(tf.reshape(tf.reduce_any(q_sum != 0), [1, 1]), new_q, q)
                return (dtensor.relayout(total, self.own[i]),
                        dtensor.relayout(share, self.stacked[i]), new_q,
                        tf.norm(q_sum), auto.beyond_shares(q_sum, r, r_max))
            return branch

        ranks = [r for r in auto.levels(r_max)[1:] if r >= floor]  # never below it
        chosen = tf.where(compressing, rank, 0)
        branches = [(0, exact)] + [(r, at_rank(r)) for r in ranks]

        def chain(k):
            r, fn = branches[k]
            if k == len(branches) - 1:
                return fn
            return lambda: tf.cond(tf.equal(chosen, r), fn, chain(k + 1))

        total, sent, new_q, norm, beyond = chain(0)()
        new = dict(st)
        new["powersgd_q"] = new_q
        nbytes = tf.where(compressing, 4 * tf.cast(sum(powersgd.matrix_shape(shape)), tf.int64)
                          * tf.cast(rank, tf.int64), tf.constant(4 * self.sizes[i], tf.int64))
        # The exact start's last `window` steps: one subspace iteration on the exact sum
        # (every device holds it: no bytes over `batch`) warms Q and measures the spectrum;
        # at its last step the first rank is the lowest whose columns beyond carried <= down_share.
        count = min(self.window, self.start)
        if count:
            def plan():
                mat = tf.reshape(dtensor.relayout(total, self._replicated(len(shape))),
                                 powersgd.matrix_shape(shape))
                q_new = powersgd.nonzero_or(auto.warm_q(mat, q), q)
                return q_new, auto.beyond_shares(q_new, r_max, r_max)
            q_plan, beyond_plan = tf.cond(planning, plan, lambda: (q, zeros_b))
            new["powersgd_q"] = where_scalar(planning, q_plan, new_q)
            beyond = where_scalar(planning, beyond_plan, beyond)
            last = tf.equal(step, self.start - 1)
            sums = st["auto_beyond_sum"] + beyond
            first = auto.lowest_rank(r_max, floor, r_max, sums / count,
                                     self.policy.down_share)
            new["auto_rank"] = tf.where(last, first, st["auto_rank"])
        else:
            sums = st["auto_beyond_sum"] + beyond
            last = tf.constant(False)
        norm_sum = st["auto_norm_sum"] + norm
        decided = self.policy.next_rank(r_max, floor, rank, norm_sum / self.window,
                                        st["auto_norm_prev"], sums / self.window)
        new["auto_rank"] = tf.where(window_end, decided, new["auto_rank"])
        new["auto_norm_prev"] = tf.where(window_end, norm_sum / self.window,
                                         st["auto_norm_prev"])
        reset = window_end | last
        new["auto_norm_sum"] = tf.where(reset, 0.0, norm_sum)
        new["auto_beyond_sum"] = where_scalar(reset, tf.zeros_like(sums), sums)
        return total, sent, new, nbytes
