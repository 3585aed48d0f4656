"""`AutoAggregator` (`--compression=auto`): how much to send, decided from the link, the
approximation error and the loss, per layer, step by step.

Every decision is made from values that are identical on every replica, so all replicas
always send messages of one length and apply the same sums (no worker can diverge):

1. **Budget from the link.** At build, two fp32 all-reduces (1 KiB and 1 MiB, the fastest
   of 5 timed calls each, taken in turn; the large one grows 4× at a time, to 64 MiB at
   most, until it takes twice the small one's time) give the link's latency `L` and
   bytes/s `B`; the slowest replica's times are gathered (max) so every replica holds the
   same pair (`measure_link`). A step may
   put `B · max(budget − 2L, budget / 4)` bytes on the wire (PowerSGD's two rounds pay `2L`
   whatever they carry). If the whole model fits in fp32, it is sent exactly (a fast link:
   compressing only costs accuracy); otherwise the budget's rank `r_budget` is the largest
   power-of-two rank (≤ 64) whose factors fit. It is each layer's floor: the budget only
   lowers ranks as far as the error allows, never raises the error above what it measured.
2. **Per layer, the spectrum of the summed gradient.** Each matrix's rank runs from its
   floor to its largest rank whose factors are smaller than the matrix (`r_max`, ≤ 64).
   It starts where the exact start's last `window` steps put it: on each of them every
   replica runs one step of PowerSGD's subspace iteration (Q ← Mᵀ orth(M Q), up to `r_max`
   columns) on the exact sum it already holds — no bytes — so Q starts compression warm,
   and the first rank is the smallest whose columns beyond carried at most `down_share` of
   the energy on those steps' mean (the rule below), `r_max` when none did (starting every
   layer at `r_max` sent too much on slow links: docs/guides/compression.md).
   Every step gives the summed gradient's energy along
   each column of P̂, `||Q_sum[:, c]||²` (the same on every replica), and so the share of
   what rank r sends that the columns beyond each lower power of two carry. At each
   window's end (`window` steps): if the top half of the columns carried at least
   `up_share` (0.25) of it on average, the spectrum is still flat at this rank and the rank
   doubles; otherwise it drops to the smallest rank (not below the floor) whose columns
   beyond carried at most `down_share` (0.1), unless the layer is in a critical regime
   (Accordion, Agarwal et al. 2021: its summed gradient's mean norm moved by at least
   `eta` since the previous window), which keeps the rank. The sum, not each replica's
   own matrix: error feedback only ever sends sums, so the residuals' differences between
   replicas grow unsent, and each replica's own share held back, `||M − P̂ P̂ᵀ M|| / ||M||`
   (also measured: `||M||²` and Q's column energies, 1 + `r_max` floats a matrix summed with
   the Q's; `comm.auto`'s `error`), rises late in a run at every rank, so no rule is made
   of it (docs/guides/compression.md).
3. **Loss guard.** `LossGuard` (a Keras callback, which the trainer adds) compares the mean
   batch loss of each compressed window with the window before; when it rose by more than
   `tolerance` and more than two standard errors of the difference (the batch losses' own
   noise), every matrix's floor doubles for the rest of the run. Keras's logged loss is
   already averaged over replicas, so every worker raises at the same step. The guard also
   records each window's ranks and errors (`comm.auto.history` of the metrics JSON).

With Adam in front (the trainer's `--compression=auto`), after the exact warm-up each
replica moves its own `v` with its own exact gradient, its noise counted once
(`adam_variance="local_debiased"`, see `Aggregator.set_adam_variance`; the other rules
for `v` measured worse on the quality suite: docs/guides/compression.md).

Before `start_step` gradients are all-reduced exactly. A rank is a per-layer `int32`
variable; the factors are cut from a `[m, r_max]` Q to the current rank inside the traced
step (dynamic shapes: nothing retraces when a rank changes), and the columns beyond it keep
their last values for when the rank grows again. `decisions()` states per layer what it
sends (rank r factors or fp32) and the mean bytes per step of the run.
"""

import math
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfpar.compression import collectives, error_feedback, powersgd
from tfpar.compression.aggregator import Aggregator, per_replica_variable
from tfpar.compression.lowrank import PowerSGDAggregator, _as_tensors

_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA
RANKS = (1, 2, 4, 8, 16, 32, 64)


def _agreed_times(strategy, small, large, repeats):
    """The fastest of `repeats` fp32 all-reduces of `small` and of `large` floats, taken in
    turn (so a burst of load hits both sizes alike), then the slowest replica's figures, so
    every replica gets the same two seconds and takes the same decisions after them."""
    opts = collectives.options()
    fns = [tf.function(lambda n=n: strategy.run(
        lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.ones([n]), options=opts))) for n in (small, large)]
    best = fastest_in_turn(
        [lambda fn=fn: tf.nest.map_structure(lambda t: t.numpy(),
                                             strategy.experimental_local_results(fn()))
         for fn in fns], repeats)
    # tf.distribute has no MAX reduction (`ReduceOp` is SUM or MEAN): gather every replica's
    # figures, then the max.
    agreed = tf.function(lambda: strategy.run(
        lambda: tf.reduce_max(tf.distribute.get_replica_context().all_gather(
            tf.constant([best], tf.float32), axis=0, options=opts), axis=0)))()
    t_small, t_large = strategy.experimental_local_results(agreed)[0].numpy()
    return float(t_small), float(t_large)


def fastest_in_turn(calls, repeats):
    """The fastest of `repeats` timed runs of each of `calls` (functions that run and wait
    for their result), taken in turn so a burst of load hits all alike; each called once
    first, untimed (it traces). Seconds, one per call."""
    for call in calls:
        call()
    best = [math.inf] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            began = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - began)
    return best


def link_of(mbps, latency_ms):
    """`(bytes_per_s, latency_s)` of `--auto_link_mbps` and `--auto_link_latency_ms`, the
    `link` `auto` decides on; None without a rate (the link is timed at build)."""
    return (mbps * 1e6 / 8, latency_ms / 1000) if mbps else None


def warm_q(matrix, q):
    """One step of PowerSGD's subspace iteration on `matrix`, `Mᵀ orth(M Q)` over all
    columns of `q`: what `auto`'s exact start runs on the exact sum to warm `Q` (zero for a
    zero `matrix`: keep the old `Q` then, `powersgd.nonzero_or`)."""
    return powersgd.compress_q(matrix, powersgd.orthogonalize(tf.matmul(matrix, q)))


def measure_link(strategy, sizes=(256, 262144), repeats=5, max_floats=1 << 24, times=None):
    """Latency (s) and bandwidth (bytes/s) of `strategy`'s fp32 all-reduce, the slowest
    replica's, identical on every replica (call in cross-replica context on every worker).

    The large message grows 4x at a time (up to `max_floats`) until it takes at least twice
    the small one's time: on a fast link 1 MB can go as quickly as 1 kB within the noise of a
    loaded machine, and a difference lost in noise is no bandwidth. Every replica grows alike
    (the decision is on the agreed figures), so all issue the same collectives.

    `times(small, large, repeats)`, if given, times the two sums instead of `strategy`'s
    all-reduce (the mesh's sum over `batch`: `tfpar.layout.auto`), the figures agreed as
    `_agreed_times` agrees them.

    Returns:
        `(bytes_per_s, latency_s)`.
    """
    small, large = sizes
    while True:
        t0, t1 = (_agreed_times(strategy, small, large, repeats) if times is None
                  else times(small, large, repeats))
        if t1 >= 2 * t0 or 4 * large > max_floats:
            break
        large *= 4
    if t1 <= t0:
        logging.warning("auto: the link's bandwidth is beyond what %d floats resolve (%.2e s "
                        "vs %.2e s for %d); taking it as 1e12 bytes/s", large, t1, t0, small)
    per_byte = max((t1 - t0) / (4 * (large - small)), 1e-12)
    latency = max(t0 - 4 * small * per_byte, 1e-6)
    return 1.0 / per_byte, latency


class AutoAggregator(PowerSGDAggregator):
    """PowerSGD whose rank per layer follows the link, the approximation error and the loss.

    Args:
        budget_ms: wall time per step the exchange may take on the measured link.
        link: `(bytes_per_s, latency_s)` to use instead of measuring (e.g. to act as on a
            slower link than the one at hand); None = measure at build.
        window: steps between rank decisions (and the loss guard's window).
        eta: relative change of a layer's gradient norm between windows that counts as a
            critical regime (Accordion): the layer's rank is not lowered at that window.
        up_share: the rank doubles when the top half of a layer's columns carried at least
            this share of the energy it sent of the summed gradient (the window's mean):
            the spectrum is still flat at this rank, so more columns would carry more.
        down_share: otherwise the rank drops to the smallest (not below the budget's) whose
            columns beyond it carried at most this share.
        start_rank: each layer's rank in the first compressed window, never below the
            budget's rank nor above the layer's largest (64 = the largest everywhere); None
            = from the spectrum of the exact start's last `window` steps (its largest when
            nothing is exact: `start_step` 0 without Adam's warm-up).
        start_step: steps of exact all-reduce before compressing.
        seed: seed of the initial Q.
        **kwargs: see `Aggregator`.

    Examples:
        >>> agg = AutoAggregator(link=(12.5e6, 1e-3))  # as on a 100 Mbit/s link
        >>> agg.budget_bytes()
        225000
    """

    lossy = True
    def __init__(self, budget_ms=20.0, link=None, window=10, eta=0.3, up_share=0.25,
                 down_share=0.1, start_rank=None, start_step=10, seed=0, **kwargs):
        if not budget_ms > 0:
            raise ValueError(f"budget_ms={budget_ms!r} is invalid: must be > 0, e.g. 20")
        if window < 1:
            raise ValueError(f"window={window!r} is invalid: must be an integer >= 1")
        if not 0 <= down_share <= up_share <= 1:
            raise ValueError(f"up_share={up_share!r}, down_share={down_share!r} are invalid: "
                             "need 0 <= down_share <= up_share <= 1, e.g. 0.25 and 0.1")
        if start_rank is not None and (isinstance(start_rank, bool) or
                                       not isinstance(start_rank, int) or start_rank < 1):
            raise ValueError(f"start_rank={start_rank!r} is invalid: must be None (each "
                             "layer's largest) or an integer >= 1")
        # With Adam in front: per-replica moments (no frozen variance). Frozen after a warm-up
        # as short as auto's exact start (2 steps in tests/test_compression_auto.py), `v` was
        # too small for the later gradients and the run diverged.
        kwargs.setdefault("adam_warmup_steps", 0)
        super().__init__(rank=max(RANKS), start_step=start_step, seed=seed, **kwargs)
        self.budget_ms = float(budget_ms)
        self.link = None if link is None else (float(link[0]), float(link[1]))
        self.window = int(window)
        self.eta = float(eta)
        self.up_share, self.down_share = float(up_share), float(down_share)
        self.start_rank = start_rank
        self.r_budget = None  # None after build: everything exact
        self.history = []  # one entry per window, appended by `record` (LossGuard calls it)

    def budget_bytes(self):
        """Bytes a step may put on the wire on `self.link`."""
        rate, latency = self.link
        budget = self.budget_ms / 1000
        return int(min(rate * max(budget - 2 * latency, budget / 4), 2 ** 62))

    def _factor_bytes(self, shapes, rank):
        total = 0
        for shape in shapes:
            if powersgd.compressible(shape, rank):
                total += 4 * sum(powersgd.matrix_shape(shape)) * powersgd.effective_rank(
                    shape, rank)
            else:
                total += 4 * math.prod(shape)
        return total

    def build(self, variables):
        if self.built:
            return
        if self.link is None:
            strategy = tf.distribute.get_strategy()
            with tf.init_scope():
                self.link = (measure_link(strategy) if strategy.num_replicas_in_sync > 1
                             else (float("inf"), 0.0))
        shapes = [tuple(int(d) for d in v.shape) for v in variables]
        self.names = [_name(v) for v in variables]
        self.r_budget = self.plan(shapes)
        start_rank = self.start_rank
        if self.r_budget is None:
            # Everything fits the budget exactly: nothing to compress, nothing to adapt, and
            # Adam stays in the optimizer.
            self.adam = None
        else:
            self.rank = self.r_budget
            self.r_max, self.r_floor = self.matrix_ranks(shapes, self.r_budget)
            self.r_start = {i: r if start_rank is None else
                            min(r, max(self.r_floor[i], _power_of_two(start_rank)))
                            for i, r in self.r_max.items()}
        super().build(variables)

    @staticmethod
    def matrix_ranks(shapes, r_budget):
        """`(r_max, r_floor)`, `{position: rank}` over the matrices among `shapes`: the
        largest rank whose factors are smaller than the matrix, and the budget's rank
        `r_budget` (not above that: the floor, since spending the budget costs no time)."""
        r_max = {i: max(r for r in RANKS if powersgd.compressible(s, r))
                 for i, s in enumerate(shapes) if powersgd.compressible(s, 1)}
        return r_max, {i: min(r_budget, r) for i, r in r_max.items()}

    def plan(self, shapes):
        """The budget's rank (the largest power of two ≤ 64 whose factors fit) for variables
        of `shapes` on `self.link`; None when fp32 fits the budget."""
        budget = self.budget_bytes()
        if sum(4 * math.prod(s) for s in shapes) <= budget:
            return None
        fits = [r for r in RANKS if self._factor_bytes(shapes, r) <= budget]
        return max(fits) if fits else 1

    def _matrices(self):
        if self.r_budget is None:
            return []
        return sorted(self.r_max)

    def _build_state(self):
        if self.r_budget is None:
            self.qs = {}
            return
        mats = self._matrices()
        shapes = self._layout.shapes
        # Q holds a layer's largest rank; the columns beyond the current rank keep their last
        # values for when the rank grows again.
        self.qs = {str(i): per_replica_variable(
            powersgd.initial_q(powersgd.matrix_shape(shapes[i])[1], self.r_max[i],
                               self.seed + i), f"powersgd_q_{i}", _FIRST) for i in mats}

        def state(value, name):
            return {str(i): per_replica_variable(tf.constant(value() if callable(value)
                                                             else value),
                                                 f"auto_{name}_{i}", _FIRST) for i in mats}

        self.ranks = {str(i): per_replica_variable(tf.constant(self.r_start[i]),
                                                   f"auto_rank_{i}", _FIRST) for i in mats}
        self.norm_sum = state(0.0, "norm")
        self.norm_prev = state(-1.0, "norm_prev")
        def per_level(fill, name):  # one entry per rank 0, 1, 2, 4, ... (`_levels`)
            return {str(i): per_replica_variable(
                tf.fill([len(self._levels(i))], fill), f"auto_{name}_{i}", _FIRST)
                for i in mats}

        # Per level, the window's sum and the last window's mean (-1: none yet): the share
        # each replica held back, and the summed gradient's energy beyond the level.
        self.error_sum, self.error_last = per_level(0.0, "error"), per_level(-1.0, "error_last")
        self.beyond_sum = per_level(0.0, "beyond")
        self.beyond_last = per_level(-1.0, "beyond_last")
        self.window_rank = {str(i): per_replica_variable(tf.constant(self.r_start[i]),
                                                         f"auto_window_rank_{i}", _FIRST)
                            for i in mats}  # the rank the last window's errors were taken at
        self.raised = per_replica_variable(tf.constant(0, tf.int32), "auto_raised", _FIRST)
        self.bytes_total = per_replica_variable(tf.constant(0, tf.int64), "auto_bytes_total",
                                                _FIRST)

    # The mesh's `auto` (`tfpar.layout.auto`) saves its step counter under this kind.
    step_kind = "auto_step"

    def own_named_state(self, paths):
        out = super().own_named_state(paths)  # the Qs
        if self.r_budget is None:
            return out
        per_matrix = {"auto_rank": self.ranks, "auto_norm_sum": self.norm_sum,
                      "auto_norm_prev": self.norm_prev, "auto_error_sum": self.error_sum,
                      "auto_error_last": self.error_last, "auto_beyond_sum": self.beyond_sum,
                      "auto_beyond_last": self.beyond_last,
                      "auto_window_rank": self.window_rank}
        for kind, variables in per_matrix.items():
            out.update({f"{paths[int(p)]}/{kind}": (v, None) for p, v in variables.items()})
        out[f"{paths[0]}/auto_raised"] = (self.raised, None)
        out[f"{paths[0]}/auto_bytes_total"] = (self.bytes_total, None)
        return out

    def _levels(self, position):
        """The ranks layer `position` can take, with 0 first (nothing sent)."""
        return levels(self.r_max[position])

    def top_share_of(self, position):
        """The last window's mean share of the summed gradient's sent energy carried by the
        top half of layer `position`'s columns (None before a window ended)."""
        beyond = self.beyond_last[str(position)].numpy()
        if beyond[0] < 0:
            return None
        rank = int(self.window_rank[str(position)].numpy())
        at = self._levels(position).index(rank)
        return round(float(beyond[at - 1]), 4)

    def error_of(self, position):
        """The last window's mean share of layer `position`'s corrected gradient held back
        at its rank then (None before a window ended)."""
        errors = self.error_last[str(position)].numpy()
        if errors[0] < 0:
            return None
        rank = int(self.window_rank[str(position)].numpy())
        return float(errors[self._levels(position).index(rank)])

    def rank_of(self, position):
        """The current rank of variable `position` (0 = sent exactly)."""
        var = getattr(self, "ranks", {}).get(str(position))
        return 0 if var is None else max(int(var.numpy()), self._floor_now(position))

    def _floor_now(self, position):
        level = int(self.raised.numpy())
        return min(self.r_floor[position] << level, self.r_max[position])

    def _floor(self, position):
        return tf.minimum(tf.bitwise.left_shift(tf.constant(self.r_floor[position]),
                                                self.raised), self.r_max[position])

    def raise_ranks(self):
        """Doubles every matrix's floor rank for the rest of the run (up to its largest);
        the next step sends at least that (call in cross-replica context on every worker
        alike: `LossGuard` does). Returns whether anything could still grow."""
        if self.r_budget is None:
            return False
        if all(self._floor_now(p) >= self.r_max[p] for p in self.r_max):
            return False
        self.raised.assign(int(self.raised.numpy()) + 1)
        return True

    def static_wire_bytes(self, positions):
        if self.r_budget is None or not hasattr(self, "r_floor"):
            return Aggregator.static_wire_bytes(self, positions)
        positions = list(positions)
        factors = sum(4 * sum(powersgd.matrix_shape(self._layout.shapes[p])) *
                      self.r_start[p] + 4 * (self.r_max[p] + 1)
                      for p in positions if p in self.r_floor)
        rest = [p for p in positions if p not in self.r_floor]
        return factors + (Aggregator.static_wire_bytes(self, rest) if rest else 0)

    def all_reduce_sum(self, grads, variables):
        out = super().all_reduce_sum(grads, variables)
        if self.r_budget is not None:
            self.bytes_total.assign_add(self.wire_bytes)
        return out

    def _residuals_in_place(self):
        # As PowerSGD's (PyTorch's hook): each replica's residual is its corrected gradient
        # minus its share of the decoded sum, updated in place, so its own message is never
        # decoded (one matmul and two passes over each matrix fewer a step).
        return self.error_feedback

    def _exchange(self, xs, positions):
        if self.r_budget is None:
            return Aggregator._exchange(self, xs, positions)
        if self.start_step <= 0:
            return self._adaptive(xs, positions)

        def plain(xs):
            out = _as_tensors(self._exchange_exactly(xs, positions))
            if self.observes_exact:
                self.on_exact_step(out[0], positions)
            return out

        def compressed(xs):
            return _as_tensors(self._adaptive(xs, positions))

        return collectives.replica_cond(self.step < self.start_step, plain, compressed, (xs,))

    @property
    def observes_exact(self):
        return self.start_rank is None and self.r_budget is not None

    def on_exact_step(self, summed, positions):
        """On the last `window` exact steps (at most `start_step`): one step of PowerSGD's
        subspace iteration per matrix on the exact sum (no bytes: every replica holds it),
        so Q starts compression warm; the summed gradient's energy along its columns, as the
        windows measure it, gives each layer's first compressed rank at the last one: the
        smallest (not below the floor) whose columns beyond carried at most `down_share`
        on the mean, the largest when none did."""
        start = max(self.start_step, self._compression_start())
        count = min(self.window, start)
        if not count:
            return
        matrices = set(self._matrices())
        todo = [(g, p) for g, p in zip(summed, positions) if p in matrices]

        def plan():
            last = tf.equal(self.step, start - 1)
            for g, p in todo:
                m = tf.reshape(g, powersgd.matrix_shape(g.shape))
                q_var = self.qs[str(p)]
                q_new = warm_q(m, q_var)
                q_var.assign(powersgd.nonzero_or(q_new, q_var))
                top = self.r_max[p]
                total = self.beyond_sum[str(p)].assign_add(self._beyond(p, q_new, top))
                first = self._lowest(p, total / count, top)
                for var in (self.ranks[str(p)], self.window_rank[str(p)]):
                    var.assign(tf.where(last, first, var))
                self.beyond_sum[str(p)].assign(tf.where(last, tf.zeros_like(total), total))
            return tf.constant(0)

        # Only on the last `count` exact steps (Adam's refresh steps later are exact too).
        tf.cond((self.step >= start - count) & (self.step < start), plan,
                lambda: tf.constant(0))

    def _adaptive(self, xs, positions):
        matrices = set(self._matrices())
        mat = [j for j, p in enumerate(positions) if p in matrices]
        rest = [j for j, p in enumerate(positions) if p not in matrices]
        if not mat:
            return Aggregator._exchange(self, xs, positions)
        ranks = [tf.maximum(self.ranks[str(positions[j])], self._floor(positions[j]))
                 for j in mat]
        summed = list(xs)
        ms = [tf.reshape(xs[j], powersgd.matrix_shape(xs[j].shape)) for j in mat]
        qs_full = [self.qs[str(positions[j])] for j in mat]
        qs = [q[:, :r] for q, r in zip(qs_full, ranks)]
        ps = [tf.matmul(m, q) for m, q in zip(ms, qs)]
        sums, p_bytes = _sum_dynamic(ps + [xs[j] for j in rest], self.collective_options)
        for j, s in zip(rest, sums[len(mat):]):
            summed[j] = tf.reshape(s, xs[j].shape)
        p_hats = [powersgd.orthogonalize(tf.reshape(s, [m.shape[0], -1]))
                  for s, m in zip(sums[:len(mat)], ms)]
        q_locals = [powersgd.compress_q(m, p) for m, p in zip(ms, p_hats)]
        # The share each replica holds back, at this rank and every lower one: P̂ is
        # orthonormal and its first k columns span P's first k (QR), so ||M − P̂ₖ P̂ₖᵀ M||² =
        # ||M||² − (the energy of Q_local's first k columns). ||M||² and each column's
        # energy (zeros up to the layer's largest rank) are summed over replicas with the Q's.
        tops = [self.r_max[positions[j]] for j in mat]
        stats = tf.concat([tf.concat([[tf.reduce_sum(tf.square(m))], tf.pad(
            tf.reduce_sum(tf.square(q), 0), [[0, top - tf.shape(q)[1]]])], 0)
            for m, q, top in zip(ms, q_locals, tops)], 0)
        q_sums, q_bytes = _sum_dynamic(q_locals + [stats], self.collective_options)
        stats = tf.split(q_sums[-1], [top + 1 for top in tops])
        window_end = tf.equal((self.step - self.start_step + 1) % self.window, 0)
        in_place = self._residuals_in_place()
        share = 1.0 / collectives.replica_context().num_replicas_in_sync
        for k, (j, m, p_hat, q_sum, q_var, r) in enumerate(zip(
                mat, ms, p_hats, q_sums, qs_full, ranks)):
            p = positions[j]
            q_sum = tf.reshape(q_sum, [m.shape[1], -1])
            shape = xs[j].shape
            summed[j] = tf.reshape(powersgd.decompress(p_hat, q_sum), shape)
            if in_place:
                error_feedback.subtract_scaled(self.residuals[str(p)], summed[j], share)
            new_q = tf.concat([q_sum, q_var[:, r:]], 1)
            q_var.assign(tf.ensure_shape(tf.where(tf.reduce_any(q_sum != 0), new_q, q_var),
                                         q_var.shape))
            total_sq, captured = stats[k][0], tf.cumsum(stats[k][1:])
            kept = tf.gather(captured, [lv - 1 for lv in self._levels(p)[1:]])
            errors = tf.sqrt(tf.maximum(total_sq - kept, 0.0) / tf.maximum(total_sq, 1e-30))
            errors = tf.where(total_sq > 0, tf.concat([[1.0], errors], 0), 0.0)
            # The summed gradient's energy along each column of P̂ (`||Q_sum[:, c]||²`, the
            # same on every replica): the share of what rank r sends that the columns from
            # each lower rank on carry. Taken from the sum, where each replica's own noise
            # and the residuals' differences between replicas (which error feedback never
            # sends: only sums go out) cancel, unlike the local shares above, which reached
            # ~0.9 at every rank late in a convnet run. ||P̂ Q_sumᵀ|| = ||Q_sum|| (P̂ is
            # orthonormal): the summed gradient's norm without another pass over it.
            self._accumulate(p, tf.norm(q_sum), errors, self._beyond(p, q_sum, r))
        # The decisions only at a window's end (the other steps only add up).
        at_end = [(positions[j], r) for j, r in zip(mat, ranks)]
        tf.cond(window_end, lambda: self._decide(at_end), lambda: tf.constant(0))
        # Unused: with error feedback the residuals were formed in place above, without it
        # there are none (so this replica's own message is never decoded); returning `xs`
        # would keep the residuals' buffers referenced (through a cond's outputs) and make
        # the in-place update copy them.
        return summed, list(summed), p_bytes + q_bytes

    def _beyond(self, p, q, rank):
        return beyond_shares(q, rank, self.r_max[p])

    def _lowest(self, p, mean_beyond, rank_now):
        return lowest_rank(self.r_max[p], self._floor(p), rank_now, mean_beyond,
                           self.down_share)

    def _accumulate(self, p, norm, errors, beyond):
        """Adds one compressed step's figures of layer `p` to its window's sums: the summed
        gradient's norm, each replica's own share held back per level (`errors`, recorded
        only) and the share of the summed gradient's sent energy beyond each level."""
        self.norm_sum[str(p)].assign_add(norm)
        self.error_sum[str(p)].assign_add(errors)
        self.beyond_sum[str(p)].assign_add(beyond)

    def _decide(self, layers):
        """At a window's end, each layer's rank for the next window (`layers`: `(p,
        rank_now)` pairs), from values the same on every replica (the window's mean share of
        the summed gradient's sent energy carried by the columns beyond each of
        `_levels(p)`): doubled when the top half of its columns carried at least `up_share`;
        else the smallest rank (not below the floor) whose columns beyond carried at most
        `down_share`, unless the layer is in a critical regime (Accordion: its summed
        gradient's mean norm moved by >= `eta` since the previous window), which keeps the
        rank. Then the window's sums start again."""
        for p, rank_now in layers:
            key = str(p)
            mean = self.norm_sum[key] / self.window
            mean_beyond = self.beyond_sum[key] / self.window
            prev = self.norm_prev[key]
            self.ranks[key].assign(self.next_rank(self.r_max[p], self._floor(p), rank_now,
                                                  mean, prev, mean_beyond))
            self.window_rank[key].assign(rank_now)
            prev.assign(mean)
            self.error_last[key].assign(self.error_sum[key] / self.window)
            self.beyond_last[key].assign(mean_beyond)
            for total in (self.norm_sum[key], self.error_sum[key], self.beyond_sum[key]):
                total.assign(tf.zeros_like(total))
        return tf.constant(0)

    def next_rank(self, r_max, floor, rank_now, mean_norm, prev_norm, mean_beyond):
        """A layer's rank for the next window (tensors, the same on every replica): doubled
        (up to `r_max`) when the top half of its columns carried at least `up_share` of
        the energy it sent (`mean_beyond`, the window's mean per level of
        `levels(r_max)`); else the smallest rank (not below `floor`) whose columns beyond
        carried at most `down_share`, unless the layer is in a critical regime (Accordion:
        its summed gradient's mean norm `mean_norm` moved by >= `eta` from `prev_norm`,
        the previous window's, <= 0 when none), which keeps `rank_now`. The mesh's `auto`
        (`tfpar.layout.auto`) decides with this too."""
        critical = tf.logical_or(prev_norm <= 0,
                                 tf.abs(mean_norm - prev_norm) >= self.eta * prev_norm)
        at = tf.argmax(tf.cast(tf.equal(tf.constant(levels(r_max)), rank_now), tf.int32),
                       output_type=tf.int32)
        up = tf.logical_and(mean_beyond[at - 1] >= self.up_share, rank_now < r_max)
        return tf.where(up, tf.minimum(2 * rank_now, r_max),
                        tf.where(critical, rank_now,
                                 lowest_rank(r_max, floor, rank_now, mean_beyond,
                                             self.down_share)))

    def _take_path_of(self, source):
        # Also `source`'s ranks and floor (a fresh copy starts at each layer's largest).
        super()._take_path_of(source)
        if self.r_budget is not None:
            for key, var in self.ranks.items():
                var.assign(source.ranks[key].read_value())
            self.raised.assign(source.raised.read_value())

    def get_config(self):
        config = {**Aggregator.get_config(self), "budget_ms": self.budget_ms,
                  "link": self.link, "window": self.window, "eta": self.eta,
                  "up_share": self.up_share, "down_share": self.down_share,
                  "start_rank": self.start_rank,
                  "start_step": self.start_step, "seed": self.seed}
        return config

    def layers(self):
        """What each variable is sent as now: `{position: {"name", "shape", "sends",
        "bytes", "error"}}`; `sends` is "rank r" (PowerSGD factors, `error` the last
        window's mean share held back) or "fp32" (exact)."""
        out = {}
        for p, shape in enumerate(self._layout.shapes):
            entry = {"name": self.names[p], "shape": list(shape)}
            rank = self.rank_of(p)
            if rank:
                entry.update(sends=f"rank {rank}",
                             bytes=4 * sum(powersgd.matrix_shape(shape)) * rank,
                             error=self.error_of(p))
            else:
                entry.update(sends="fp32", bytes=4 * math.prod(shape))
            out[str(p)] = entry
        return out

    def record(self, loss=None, raised=False):
        """Appends this window's decisions to `history` (ranks, errors, the guard)."""
        if self.r_budget is None:
            return
        self.history.append({
            "step": int(self.step.numpy()), "loss": loss, "raised": bool(raised),
            "floor_level": int(self.raised.numpy()),
            "ranks": {p: self.rank_of(int(p)) for p in self.ranks},
            "errors": {p: self.error_of(int(p)) for p in self.ranks},
            "window_ranks": {p: int(v.numpy()) for p, v in self.window_rank.items()},
            "top_half_share": {p: self.top_share_of(int(p)) for p in self.ranks}})

    def decisions(self):
        """`{"link": ..., "r_budget", "layers": {position: what it sends}, "history"}`."""
        out = {"bytes_per_s": self.link[0], "latency_s": self.link[1],
               "r_budget": self.r_budget, "budget_bytes": self.budget_bytes(),
               "up_share": self.up_share, "down_share": self.down_share}
        if self.r_budget is not None:
            steps = int(self.step.numpy())
            out["ranks"] = {p: self.rank_of(int(p)) for p in self.ranks}
            out["floor_level"] = int(self.raised.numpy())
            out["layers"] = self.layers()
            out["mean_bytes_per_step"] = (int(self.bytes_total.numpy()) / steps
                                          if steps else 0.0)
            out["history"] = self.history
        return out


def levels(r_max):
    """The ranks a layer whose largest rank is `r_max` can take, with 0 first (nothing
    sent)."""
    return [0] + [r for r in RANKS if r <= r_max]


def beyond_shares(q, rank, r_max):
    """Per level of `levels(r_max)`, the share of the energy that rank `rank` sends (the
    columns of `q`, at most `r_max`: `||q[:, c]||²`) carried by the columns beyond it; all
    zeros when nothing is sent."""
    sum_e = tf.cumsum(tf.pad(tf.reduce_sum(tf.square(q), 0), [[0, r_max - tf.shape(q)[1]]]))
    sent = sum_e[rank - 1]
    beyond = tf.concat([[1.0], 1.0 - tf.gather(sum_e, [lv - 1 for lv in levels(r_max)[1:]])
                        / tf.maximum(sent, 1e-30)], 0)
    return tf.where(sent > 0, tf.maximum(beyond, 0.0), 0.0)


def lowest_rank(r_max, floor, rank_now, mean_beyond, down_share):
    """The smallest level of `levels(r_max)`, not below `floor` nor above `rank_now`, whose
    columns beyond carried at most `down_share` on `mean_beyond`; else `rank_now`."""
    ranks = tf.constant(levels(r_max))
    enough = (ranks >= floor) & (ranks <= rank_now) & (mean_beyond <= down_share)
    return tf.reduce_min(tf.where(enough, ranks, rank_now))


def _power_of_two(n):
    return 1 << (int(n).bit_length() - 1)


def _name(variable):
    return str(getattr(variable, "path", None) or getattr(variable, "name", ""))


def _sum_dynamic(tensors, opts):
    """All `tensors` (some of dynamic size) summed over replicas in one fp32 all-reduce;
    every replica has the same sizes, so the buffers line up."""
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
    sizes = [tf.size(t) for t in tensors]
    total, nbytes = collectives.sum_all(flat, opts)
    return tf.split(total, tf.stack(sizes), num=len(tensors)), nbytes


class LossGuard(keras.callbacks.Callback):
    """Sends more when the loss drifts up: after each compressed window of `window` steps,
    if its mean batch loss exceeds the previous window's by more than `tolerance`
    (relative) and by more than two standard errors of the two means' difference (the
    batch losses' own noise), every matrix's floor rank doubles for the rest of the run
    (`AutoAggregator.raise_ranks`). Also records each window's decisions in the
    aggregator's `history` (the metrics JSON's `comm.auto.history`).

    Args:
        aggregator: an `AutoAggregator`.
        tolerance: relative rise of the window's mean loss that raises the ranks.
    """

    def __init__(self, aggregator, tolerance=0.02):
        super().__init__()
        self.aggregator = aggregator
        self.tolerance = float(tolerance)
        self.losses, self._k, self._mean = [], 0, 0.0
        self.raises = []  # steps after which the guard raised the ranks

    def on_epoch_begin(self, epoch, logs=None):
        self._k, self._mean = 0, 0.0

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        mean = float(logs.get("loss", math.nan))
        self._k += 1
        if "step_loss" in logs:  # tfpar's trainer: the step's own loss (tfpar.metrics)
            self.losses.append(float(logs["step_loss"]))
        else:
            # A plain `fit` logs only the epoch's running mean: this batch's loss from it,
            # within float32 rounding.
            self.losses.append(self._k * mean - (self._k - 1) * self._mean)
        self._mean = mean
        agg, w = self.aggregator, self.aggregator.window
        if agg.r_budget is None or len(self.losses) % w:
            return
        # Compressed for the whole window: after auto's exact start and Adam's warm-up.
        first = max(agg.start_step, agg._compression_start())
        now = float(np.mean(self.losses[-w:]))
        raised = False
        if len(self.losses) - w >= first and len(self.losses) >= 2 * w:
            window, previous = self.losses[-w:], self.losses[-2 * w:-w]
            before = float(np.mean(previous))
            # A rise counts when above `tolerance` and above two standard errors of the
            # difference of the two means (batch losses are noisy between windows).
            noise = 2 * math.sqrt((np.var(window) + np.var(previous)) / w)
            if now - before > max(before * self.tolerance, noise):
                raised = agg.raise_ranks()
                if raised:
                    self.raises.append(len(self.losses))
        if len(self.losses) > first:
            agg.record(loss=round(now, 6), raised=raised)
