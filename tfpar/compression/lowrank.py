"""`PowerSGDAggregator`: gradients of matrices sent as rank-r factors (see `powersgd`)."""

import collections

import tensorflow as tf

from tfpar import patches
from tfpar.compression import collectives, error_feedback, powersgd
from tfpar.compression.aggregator import Aggregator, per_replica_variable
from tfpar.compression.dense import NoneAggregator


class PowerSGDAggregator(NoneAggregator):
    """Rank-`rank` PowerSGD with warm-started Q and error feedback.

    Per step: all matrices' `P = M Q` in one all-reduce, together with the vectors, biases
    and matrices too small to gain (uncompressed, fp32), orthogonalise, all matrices'
    `Q = Mᵀ P̂` in a second all-reduce: two collectives per step, however many tensors.
    With `groups` > 1 the matrices are split, last layers first, into that many groups of
    about equal size, each with its own two all-reduces (a bias goes with its kernel): the
    last layers' rounds can run while backward still computes the first layers' gradients,
    at the cost of two more collectives' latency a group. The sums are the same either way
    (each factor entry is summed over the same replicas).
    Before `start_step` everything is all-reduced uncompressed (the early gradients change
    fastest and PowerSGD's warm start has not settled).

    Error feedback as PyTorch's hook: each replica's residual is its corrected gradient
    minus its share (`1 / replicas`) of the summed approximation `P̂ Q_sumᵀ`, which is decoded
    anyway, instead of minus its own message `P̂ Q_localᵀ` (a second decode per matrix). The
    residuals' sum over replicas, the debt error feedback carries, is the same either way.
    The residual variables are updated in place (`error_feedback.accumulate`,
    `error_feedback.subtract_scaled`): one pass over each matrix for `g + r`, one for the
    new residual.

    Whether the sums it hands back are all finite is known from the small tensors
    (`certainly_finite`): the uncompressed sums, `P̂` and the summed `Q`, with a bound on
    `P̂ Q_sumᵀ`; `--on_nan`'s guard then skips its pass over the full sums on ordinary
    steps.

    Args:
        rank: rank of the approximation.
        start_step: aggregator steps of plain all-reduce before compressing.
        seed: seed of the initial Q (must be the same on every replica and worker).
        groups: how many pairs of all-reduces a step sends (1: one for every P, one for
            every Q); at most one group per compressed matrix.
        **kwargs: see `Aggregator`.
    """

    lossy = True
    adam_compresses = "gradient"  # see `Aggregator.adam_compresses`

    def __init__(self, rank=4, start_step=0, seed=0, groups=1, **kwargs):
        if rank < 1:
            raise ValueError(f"rank={rank!r} is invalid: must be an integer >= 1")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups={groups!r} is invalid: must be an integer >= 1 "
                             "(1: one all-reduce for every P, one for every Q)")
        super().__init__(**kwargs)
        self.rank = int(rank)
        self.start_step = int(start_step)
        self.seed = int(seed)
        self.groups = groups
        # This replica's `certainly_finite` of the step last traced, by replica.
        self._hints = patches.no_dependency({})

    def _matrices(self):
        return [i for i, s in enumerate(self._layout.shapes)
                if powersgd.compressible(s, self.rank)]

    def _lossy_positions(self):
        return self._matrices()

    def _build_state(self):
        self.qs = {
            str(i): per_replica_variable(
                powersgd.initial_q(powersgd.matrix_shape(self._layout.shapes[i])[1],
                                   powersgd.effective_rank(self._layout.shapes[i], self.rank),
                                   self.seed + i),
                f"powersgd_q_{i}", tf.VariableAggregation.ONLY_FIRST_REPLICA)
            for i in self._matrices()}

    def own_named_state(self, paths):
        return {f"{paths[int(p)]}/powersgd_q": (q, None) for p, q in self.qs.items()}

    def static_wire_bytes(self, positions):
        positions = list(positions)
        matrices = set(self._matrices())
        factors = sum(4 * sum(powersgd.matrix_shape(self._layout.shapes[p])) *
                      powersgd.effective_rank(self._layout.shapes[p], self.rank)
                      for p in positions if p in matrices)
        rest = [p for p in positions if p not in matrices]
        return factors + (super().static_wire_bytes(rest) if rest else 0)

    def _residuals_in_place(self):
        # Subclasses with their own exchange form their residuals the base class's way
        # unless they say otherwise (auto does).
        return self.error_feedback and type(self)._exchange is PowerSGDAggregator._exchange

    def _compress_and_exchange(self, inputs, positions):
        if not self._residuals_in_place():
            return super()._compress_and_exchange(inputs, positions)
        inputs = self._before_compress(inputs, positions)
        xs = [error_feedback.accumulate(self.residuals[str(p)], x)
              if str(p) in self.residuals else x for x, p in zip(inputs, positions)]
        summed, _, nbytes = self._exchange(xs, positions)
        return summed, nbytes

    def _exchange(self, xs, positions):
        self._hints.pop(_replica_key(), None)
        if self.start_step <= 0:
            return self._compressed(xs, positions, hint=True)

        def plain(xs):
            return _as_tensors(self._exchange_exactly(xs, positions))

        def compressed(xs):
            return _as_tensors(self._compressed(xs, positions))

        return collectives.replica_cond(self.step < self.start_step, plain, compressed, (xs,))

    def _exchange_exactly(self, xs, positions):
        """The plain all-reduce of the steps before `start_step`; with the residuals in
        place, sent exactly, they keep nothing back."""
        summed, local, nbytes = Aggregator._exchange(self, xs, positions)
        if self._residuals_in_place():
            for p in positions:
                if str(p) in self.residuals:
                    self.residuals[str(p)].assign(tf.zeros_like(self.residuals[str(p)]))
            local = summed  # (unused; not the residuals' buffers, see `_compressed`)
        return summed, local, nbytes

    def _compressed(self, xs, positions, hint=False):
        matrices = set(self._matrices())
        mat = [j for j, p in enumerate(positions) if p in matrices]
        if not mat:
            return Aggregator._exchange(self, xs, positions)
        summed, local, nbytes, small = list(xs), list(xs), 0, []
        # The collectives run in the order they are built (tf.distribute orders them):
        # each group's P round, then its Q round (every P round first was no faster in
        # `tools/profile_powersgd.py`, 2026-12-06).
        for group_mat, group_rest in self._groups(xs, positions, mat):
            p_round, p_bytes = self._p_round(xs, positions, group_mat, group_rest, summed)
            nbytes += p_bytes + self._q_round(xs, positions, p_round, summed, local, small)
        if hint:  # every position is in one group: the small sums cover them all
            ranks = [int(self.qs[str(positions[j])].shape[1]) for j in mat]
            self._hints[_replica_key()] = _certainly_finite(small, max(ranks))
        if self._residuals_in_place():
            # Unused; returning `xs` would keep the residuals' buffers referenced (through a
            # cond's outputs) and make the in-place update copy them.
            local = list(summed)
        return summed, local, nbytes

    def _groups(self, xs, positions, mat):
        """`[(matrices, uncompressed), ...]` (indices into `xs`), last layers first: the
        matrices cut into `self.groups` runs of about equal size, each uncompressed tensor
        with the nearest matrix before it (a bias with its kernel; leading ones with the
        first matrix)."""
        count = min(self.groups, len(mat))
        sizes = [xs[j].shape.num_elements() for j in mat]
        runs, cur, filled = [], [], 0
        for k in reversed(range(len(mat))):
            cur.append(mat[k])
            filled += sizes[k]
            if len(runs) < count - 1 and filled >= sum(sizes) * (len(runs) + 1) / count:
                runs.append(cur)
                cur = []
        if cur:  # (empty when a large last matrix filled the last share early)
            runs.append(cur)
        group_of = {j: g for g, run in enumerate(runs) for j in run}
        rest = [[] for _ in runs]
        for j in range(len(positions)):
            if j not in group_of:
                before = [m for m in mat if m < j]
                rest[group_of[before[-1] if before else mat[0]]].append(j)
        return [(sorted(run), r) for run, r in zip(runs, rest)]

    def _p_round(self, xs, positions, mat, rest, summed):
        """A group's first all-reduce: its P's with its uncompressed tensors (whose sums go
        to `summed`); returns what its Q round needs and the bytes sent."""
        ms = [tf.reshape(xs[j], powersgd.matrix_shape(xs[j].shape)) for j in mat]
        qs = [self.qs[str(positions[j])] for j in mat]
        # The uncompressed vectors ride with the P's (exact, so nothing for error feedback).
        sums, p_bytes, p_total = self._sum_flat(self._encode_p(ms, qs) +
                                                [xs[j] for j in rest])
        for j, s in zip(rest, sums[len(mat):]):
            summed[j] = s
        return (mat, ms, qs, sums[:len(mat)], p_total), p_bytes

    def _q_round(self, xs, positions, p_round, summed, local, small):
        """A group's second all-reduce, its Q's, after `_p_round`; fills `summed` and
        `local` at its matrices, appends to `small` the tensors every sum of the group is
        made of (the P round's sums, each `P̂`, the Q round's sums), returns the bytes
        sent."""
        mat, ms, qs, p_sums, p_total = p_round
        p_hats = self._orthogonalize(p_sums)
        q_locals = self._encode_q(ms, p_hats)
        q_sums, q_bytes, q_total = self._sum_flat(q_locals)
        small.append(_Small(p_total, p_hats, q_total))
        in_place = self._residuals_in_place()
        share = 1.0 / collectives.replica_context().num_replicas_in_sync
        for j, p_hat, q_loc, q_sum, q_var in zip(mat, p_hats, q_locals, q_sums, qs):
            if in_place:
                summed[j] = self._decode_sum(p_hat, q_sum, xs[j].shape)
                error_feedback.subtract_scaled(self.residuals[str(positions[j])], summed[j],
                                               share)
            elif self.error_feedback:  # the base class's residual: minus its own message
                summed[j], local[j] = self._decode(p_hat, q_sum, q_loc, xs[j].shape)
            else:  # no residuals: this replica's own message is never read
                summed[j] = local[j] = self._decode_sum(p_hat, q_sum, xs[j].shape)
            # Warm start from the summed Q (the previous one for an all-zero gradient).
            q_var.assign(powersgd.nonzero_or(q_sum, q_var))
        return q_bytes

    @staticmethod
    def _encode_p(ms, qs):
        """Every matrix's first factor `M Q`, before the sum over replicas."""
        return [powersgd.compress_p(m, q) for m, q in zip(ms, qs)]

    @staticmethod
    def _orthogonalize(ps):
        """`P̂` of every summed `P`: one batched QR per distinct shape (a transformer's or
        an MLP's many same-shape kernels), not one op per matrix."""
        out = [None] * len(ps)
        by_shape = {}
        for k, p in enumerate(ps):
            by_shape.setdefault(tuple(p.shape), []).append(k)
        for ks in by_shape.values():
            if len(ks) == 1:
                out[ks[0]] = powersgd.orthogonalize(ps[ks[0]])
                continue
            for k, q in zip(ks, tf.unstack(powersgd.orthogonalize(tf.stack([ps[k] for k in ks])))):
                out[k] = q
        return out

    @staticmethod
    def _encode_q(ms, p_hats):
        """Every matrix's second factor `Mᵀ P̂`, before the sum over replicas."""
        return [powersgd.compress_q(m, p) for m, p in zip(ms, p_hats)]

    @staticmethod
    def _decode_sum(p_hat, q_sum, shape):
        """The summed gradient `P̂ Q_sumᵀ`, in the gradient's shape."""
        return tf.reshape(powersgd.decompress(p_hat, q_sum), shape)

    @staticmethod
    def _decode(p_hat, q_sum, q_local, shape):
        """`(summed, local)`: the summed gradient `P̂ Q_sumᵀ` and what this replica's own
        message decodes to, `P̂ Q_localᵀ` (for error feedback), in the gradient's shape."""
        return (tf.reshape(powersgd.decompress(p_hat, q_sum), shape),
                tf.reshape(powersgd.decompress(p_hat, q_local), shape))

    def _sum_flat(self, tensors):
        """All `tensors` summed over replicas in one fp32 all-reduce: `(sums, bytes, the
        flat sum)`."""
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
        total, nbytes = collectives.sum_all(flat, self.collective_options)
        parts = tf.split(total, [t.shape.num_elements() for t in tensors])
        return [tf.reshape(p, t.shape) for p, t in zip(parts, tensors)], nbytes, total

    def certainly_finite(self):
        """A boolean tensor of the step being traced, true only if every sum this
        replica's last `all_reduce_sum` handed back is finite, judged from the small
        tensors they are made of; None when that call did not compress in this graph
        (before `start_step`, inside another function's branch): check the sums
        themselves. False does not mean a sum is non-finite (check them then)."""
        hint = self._hints.get(_replica_key())
        if tf.executing_eagerly():
            return hint if hint is not None and not hasattr(hint, "graph") else None
        return hint if getattr(hint, "graph", None) is tf.compat.v1.get_default_graph() else None

    def get_config(self):
        return {**super().get_config(), "rank": self.rank, "start_step": self.start_step,
                "seed": self.seed, "groups": self.groups}


# What a group's sums are made of: its P round's flat sum (the P's and the uncompressed
# tensors), its `P̂`s, its Q round's flat sum.
_Small = collections.namedtuple("_Small", ["p_total", "p_hats", "q_total"])


def _certainly_finite(small, rank):
    """True only if the uncompressed sums and every `P̂ Q_sumᵀ` are finite, from `small`
    (`_Small`s) and the largest rank: each decoded entry is a sum of `rank` products
    `P̂_ik Q_jk`, so below `rank · max|P̂| · max|Q|` (with rounding: twice that); where that
    bound is finite nothing overflows. The P round's sums are checked whole (the
    uncompressed tensors are among them); a non-finite `P̂` or `Q` fails the check."""
    p_hats = tf.concat([tf.reshape(p, [-1]) for s in small for p in s.p_hats], 0)
    p_totals = [s.p_total for s in small]
    q_totals = tf.concat([s.q_total for s in small], 0)
    bound = (tf.reduce_max(tf.abs(p_hats)) * tf.reduce_max(tf.abs(q_totals))
             * (2.0 * rank))
    return tf.reduce_all(tf.stack(
        [tf.reduce_all(tf.math.is_finite(t)) for t in [*p_totals, p_hats, q_totals]]
        + [tf.math.is_finite(bound)]))


def _replica_key():
    """This replica's index while a step is traced (None outside a strategy): the replicas
    of one `MirroredStrategy` trace through the same aggregator one after another."""
    ctx = tf.distribute.get_replica_context()
    replica = None if ctx is None else tf.get_static_value(ctx.replica_id_in_sync_group)
    return None if replica is None else int(replica)


def _as_tensors(result):
    # tf.cond branches must return tensors of matching structure.
    summed, local, nbytes = result
    return list(summed), list(local), tf.cast(nbytes, tf.int64)
