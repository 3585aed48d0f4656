"""Sparse aggregators: each replica sends only some entries, as (value, index) pairs.

Sums of sparse vectors with different supports cannot go through an all-reduce, so every
replica all-gathers all replicas' pairs (one int32 buffer: value bits then indices) and
scatters them into a dense sum, in replica order so that every replica gets the same bits.
Error feedback (on by default) carries the entries not sent into the next step.
"""

import math

import tensorflow as tf

from tfpar import patches
from tfpar.config import (THRESHOLD, TOPK_DENSE_BELOW, TOPK_MOMENTUM_CARRY, TOPK_RATIO,
                          TOPK_UNION)
from tfpar.compression import codecs, collectives
from tfpar.compression.aggregator import (Aggregator, PerReplicaSlot, check_count,
                                         per_replica_variable)


def warmup_density(step, ratio, warmup_steps, start=0.25):
    """DGC's sparsity warm-up: the fraction of entries top-k sends at `step`.

    The density decays exponentially from `start` at step 0 to `ratio` at `warmup_steps`
    (Lin et al. 2018, Deep Gradient Compression: 25 %, 6.25 %, ... down to the target), and
    stays at `ratio` from then on. Early gradients change fast; sending more of them while
    the residuals are young keeps error feedback from delaying the first, largest updates
    by ~1/ratio steps.

    Args:
        step: the aggregator's step (0 = the first exchange).
        ratio: the target density, in (0, 1].
        warmup_steps: steps of the decay; 0 = no warm-up.
        start: the density at step 0 (no warm-up when it is not above `ratio`).

    Returns:
        float in (0, 1].
    """
    if step >= warmup_steps or start <= ratio:
        return ratio
    return start * (ratio / start) ** (step / warmup_steps)


def _sum_gathered(rows, n):
    """Dense sum of the gathered `[replicas, 2k]` sparse messages."""
    values, indices = codecs.unpack_sparse(rows)
    replicas = collectives.replica_context().num_replicas_in_sync
    return tf.add_n([codecs.densify(values[r], indices[r], n) for r in range(replicas)])


def union_sum(flat, gathered_indices, sum_all, whole=None):
    """Every replica's entries of 1-D `flat` at the union of all replicas' indices, summed.

    `gathered_indices` (`[replicas, k]`, the same on every replica) is sorted and each
    index after its first occurrence sends 0.0, so every replica sends its own values at
    the same `replicas × k` positions and `sum_all` (an all-reduce) adds them; duplicates
    add zeros when densified. `whole` (`(values, indices)` of entries sent whole, or None)
    rides in the same all-reduce, after the union's values.

    Returns:
        `(summed, local, wire_bytes)`: dense sums, this replica's own sent values (dense;
        zero off the union and `whole`), and the bytes handed to `sum_all`.
    """
    n = int(flat.shape[0])
    order = tf.sort(tf.reshape(gathered_indices, [-1]))
    first = tf.concat([[True], order[1:] != order[:-1]], 0)
    mine = tf.where(first, tf.gather(flat, order), tf.zeros([], flat.dtype))
    if whole is not None:
        mine, order = tf.concat([mine, whole[0]], 0), tf.concat([order, whole[1]], 0)
    total, nbytes = sum_all(mine)
    return codecs.densify(total, order, n), codecs.densify(mine, order, n), nbytes


def _union_exchange(flat, indices, whole, opts):
    def sum_all(x):
        return collectives.sum_all(x, opts)

    if indices is None:  # every tensor of the bucket sent whole: one exact sum
        total, nbytes = sum_all(whole[0])
        n = int(flat.shape[0])
        return codecs.densify(total, whole[1], n), codecs.densify(whole[0], whole[1], n), nbytes
    rows, index_bytes = collectives.gather_rows(indices, opts)
    summed, local, nbytes = union_sum(flat, rows, sum_all, whole)
    return summed, local, index_bytes + nbytes


def _gather_exchange(flat, values, indices, whole, opts):
    """Plain top-k: every replica's `(value, index)` pairs all-gathered in one int32 buffer,
    the values of `whole` (no indices: the same entries on every replica) after them."""
    n = int(flat.shape[0])
    words = [] if values is None else [codecs.pack_sparse(values, indices)]
    if whole is not None:
        words.append(tf.bitcast(whole[0], tf.int32))
    rows, nbytes = collectives.gather_rows(tf.concat(words, 0), opts)
    summed, local = tf.zeros([n]), tf.zeros([n])
    if whole is not None:
        w = int(whole[0].shape[0])
        rows, whole_rows = rows[:, :-w], tf.bitcast(rows[:, -w:], tf.float32)
        # In replica order, as `_sum_gathered`, so every replica gets the same bits.
        summed = codecs.densify(tf.add_n(tf.unstack(whole_rows)), whole[1], n)
        local = codecs.densify(whole[0], whole[1], n)
    if values is not None:
        summed += _sum_gathered(rows, n)
        local += codecs.densify(values, indices, n)
    return summed, local, nbytes


class TopKAggregator(Aggregator):
    """Sends the `ratio` largest-magnitude entries of each tensor (at least one each).

    The choice is per tensor rather than over the whole bucket, so a layer whose gradients
    are small next to another's still moves every step; all of a bucket's pairs still go in
    one all-gather.

    With `momentum` (Deep Gradient Compression's momentum correction, Lin et al. 2018) each
    replica keeps its own velocity `u = momentum·u + g` and compresses that (plus the
    residual) instead of the raw gradient, so the momentum of entries that wait in the
    residual is not lost; the optimizer must then apply the sum as plain SGD —
    `wrap_optimizer` moves an SGD optimizer's momentum into the aggregator. With
    `momentum_masking` (DGC's momentum factor masking) the velocity of the entries just
    sent is reset, so a sent update does not keep pushing from a stale velocity.

    With `warmup_steps` (DGC's sparsity warm-up) the first steps send more: the density
    decays exponentially from `warmup_start` to `ratio` over `warmup_steps` steps (see
    `warmup_density`), so those steps put more bytes on the wire (`comm_stats()` reports
    each step's own count; before the first step it gives the count after the warm-up).

    With `union` every replica first all-gathers its top-k indices and then sends its own
    values at the union of all replicas' indices, summed by an all-reduce (`union_sum`):
    each entry of the sum is then either the exact sum over replicas or nothing, and every
    replica's residual is emptied at the same entries. Without it a replica sends an entry
    when its own (noisy) value is large and another replica sends the same entry steps
    later, so noise that cancels in an uncompressed sum reaches the weights twice, with
    opposite signs, steps apart. It costs `4k` bytes of indices plus `4k × replicas` of
    values per replica (against `8k`): 1.5× plain top-k's bytes at 2 replicas, and it grows
    with the replicas. `dense_below` sends tensors of at most that many entries whole
    (biases, norms: a per-tensor top-k would move each of their entries once in 1/ratio
    steps, for bytes that barely count): their values only, 4 B per entry, at the end of
    the union's all-reduce (or of the all-gather's buffer without the union). So is every
    tensor whose sparse message would not be smaller than that (`sends_whole`): top-k never
    sends a tensor in more bytes than fp32 does, and where it would, the sum is exact.

    With Adam in front and the momentum synced (`adam_sync_momentum`), an entry nobody sent
    loses its momentum: what it would have added over the next steps waits in no residual.
    `adam_momentum_carry` α applies `α · β₁ · m` — the synced momentum's continuation,
    identical on every replica, so it needs no bytes — whether or not the entry is sent, and
    compresses only the rest of the step (α = 1: the momentum of the summed compressed
    gradients; α = 0: all of it through top-k).

    Args:
        ratio: fraction of entries sent, in (0, 1]; 0.01 sends ~2 % of fp32's bytes (a
            value and an index per entry). Default 0.25, the trainer's `--topk_ratio`
            (this and the other defaults: `tfpar.config.TOPK_*`).
        momentum: DGC momentum correction in [0, 1); 0 = off. Needs error feedback.
        momentum_masking: reset the velocity of the entries sent.
        warmup_steps: steps over which the density decays to `ratio`; 0 = off.
        warmup_start: the density at the first step, in (0, 1].
        dense_below: tensors of at most this many entries are sent whole; 0 = none
            (default 1024).
        union: send every replica's values at the union of all replicas' indices
            (default True).
        adam_momentum_carry: with Adam in front and the momentum synced, the share in
            [0, 1] of the synced momentum's continuation applied outside the compression.
        **kwargs: see `Aggregator`.

    Examples:
        >>> agg = TopKAggregator(0.01, warmup_steps=30)
        >>> [round(agg.density(s), 4) for s in (0, 15, 30)]
        [0.25, 0.05, 0.01]
    """

    lossy = True

    @property
    def adam_sync_momentum(self):
        """Sync Adam's momentum after each compressed step (`Aggregator.adam_sync_momentum`)
        when an entry is sent at least once per momentum time constant on average
        (`ratio >= 1 − β₁`, 10 % for Keras's Adam). Syncing zeroes the momentum of entries not
        sent, and what that momentum would have added later is kept nowhere: entries that
        wait much longer than `1/(1 − β₁)` steps then move slower (docs/guides/compression.md)."""
        return self.adam is not None and self.ratio >= 1 - self.adam[0]

    def __init__(self, ratio=TOPK_RATIO, momentum=0.0, momentum_masking=True, warmup_steps=0,
                 warmup_start=0.25, dense_below=TOPK_DENSE_BELOW, union=TOPK_UNION,
                 adam_momentum_carry=TOPK_MOMENTUM_CARRY, **kwargs):
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio={ratio!r} is invalid: must be in (0, 1]")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum={momentum!r} is invalid: must be in [0, 1)")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) \
                or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} is invalid: must be an integer "
                             ">= 0 (0 = no warm-up)")
        if not 0 < warmup_start <= 1:
            raise ValueError(f"warmup_start={warmup_start!r} is invalid: must be in (0, 1], "
                             "e.g. 0.25 for 25 %")
        check_count("dense_below", dense_below, "0 = every tensor sparse")
        if not 0 <= adam_momentum_carry <= 1:
            raise ValueError(f"adam_momentum_carry={adam_momentum_carry!r} is invalid: must be "
                             "in [0, 1] (0 = the synced momentum only where sent)")
        super().__init__(**kwargs)
        if momentum and not self.error_feedback:
            raise ValueError(f"momentum={momentum!r} needs error_feedback=True: the residual "
                             "is where DGC accumulates the velocity")
        self.ratio = float(ratio)
        self.momentum = float(momentum)
        self.momentum_masking = bool(momentum_masking)
        self.warmup_steps = warmup_steps
        self.warmup_start = float(warmup_start)
        self.dense_below = dense_below
        self.union = bool(union)
        self.adam_momentum_carry = float(adam_momentum_carry)
        # Checked again now that the ratio is known (`_takes_local_variance`).
        self.set_adam_variance(self.adam_variance, self.adam_refresh_every)

    def _takes_local_variance(self):
        # Called first from `Aggregator.__init__`, before the ratio is set; checked again.
        return not hasattr(self, "ratio") or super()._takes_local_variance()

    def _build_state(self):
        velocities = {}
        if self.momentum:
            velocities = {
                str(i): per_replica_variable(tf.zeros(self._layout.shapes[i]), f"velocity_{i}",
                                             tf.VariableAggregation.MEAN)
                for i in self._lossy_positions()}
        self.velocities = patches.no_dependency(velocities)
        self.velocity_slots = {k: PerReplicaSlot(v) for k, v in velocities.items()}

    def own_named_state(self, paths):
        return {f"{paths[int(p)]}/dgc_velocity": (v, "sum") for p, v in self.velocities.items()}

    def _before_compress(self, xs, positions):
        if not self.momentum:
            return xs
        return [self.momentum * self.velocities[str(p)] + x for x, p in zip(xs, positions)]

    def _after_compress(self, inputs, local, positions):
        if not self.momentum:
            return
        for u, sent, p in zip(inputs, local, positions):  # inputs: the new velocities
            # A tensor sent whole keeps its velocity: masking it every step would make its
            # update plain SGD (DGC masks what sparsification sent late, not exact sums).
            if self.momentum_masking and not self.sends_whole(
                    math.prod(self._layout.shapes[p])):
                u = tf.where(sent != 0, tf.zeros_like(u), u)
            self.velocities[str(p)].assign(u)

    def density(self, step):
        """Fraction of entries sent at aggregator step `step` (`ratio` after the warm-up)."""
        return warmup_density(step, self.ratio, self.warmup_steps, self.warmup_start)

    def sends_whole(self, size):
        """Whether a tensor of `size` entries goes whole (its values only, summed exactly):
        at most `dense_below` entries, or — once built, the replicas known — when its sparse
        message at `ratio` would be no smaller than its values (`_sparse_bytes`; with the
        union at 25 % from 3 replicas on)."""
        if size <= self.dense_below:
            return True
        if getattr(self, "_replicas", None) is None:
            return False
        k = min(size, max(1, math.ceil(self.ratio * size)))
        return self._sparse_bytes(k) >= 4 * size

    def _sparse_bytes(self, k):
        """Bytes of a tensor's sparse message of `k` entries (call after `build`)."""
        if self.union:  # the indices, then the values on every replica's indices
            return 4 * k + 4 * k * self._replicas
        return 8 * k  # a value and an index per entry

    def k(self, size, step=None):
        """Entries sent from a tensor of `size` entries at `step` (default: after the
        warm-up)."""
        if self.sends_whole(size):
            return size
        density = self.ratio if step is None else self.density(step)
        return min(size, max(1, math.ceil(density * size)))

    def wire_bytes_at(self, step):
        """Bytes this replica hands to the collectives at `step` (call after `build`)."""
        return sum(self._tensor_wire_bytes(math.prod(shape), step)
                   for shape in self._layout.shapes)

    def _k_now(self, size):
        if not self.warmup_steps:
            return self.k(size)
        # The same table on every replica, so all send messages of one length. With Adam's
        # exact warm-up in front, the density warm-up starts when compression does.
        table = tf.constant([self.k(size, s) for s in range(self.warmup_steps + 1)], tf.int32)
        step = self.step - self._compression_start()
        return tf.gather(table, tf.clip_by_value(step, 0, self.warmup_steps))

    def _exchange_bucket(self, flat, bucket):
        values, indices, whole, whole_at, offset = [], [], [], [], 0
        step = tf.cast(self.step, tf.int32)
        for part, size in zip(tf.split(flat, list(bucket.sizes)), bucket.sizes):
            if self.sends_whole(size):  # no top-k, no indices on the wire
                whole.append(part)
                whole_at.append(tf.range(offset, offset + size))
            else:
                # Large tensors: exact top-k through a sampled threshold (cheaper than top_k).
                v, i = codecs.topk_sampled(part, self._k_now(size), tf.stack([step, offset]))
                values.append(v)
                indices.append(i + offset)
            offset += size
        whole = (tf.concat(whole, 0), tf.concat(whole_at, 0)) if whole else None
        values = tf.concat(values, 0) if values else None
        indices = tf.concat(indices, 0) if indices else None
        if self.union:
            return _union_exchange(flat, indices, whole, self.collective_options)
        return _gather_exchange(flat, values, indices, whole, self.collective_options)

    def _tensor_wire_bytes(self, size, step=None):
        """Bytes one tensor of `size` entries adds to its bucket's collectives."""
        if self.sends_whole(size):  # its values only, in the all-reduce or the all-gather
            return 4 * size
        return self._sparse_bytes(self.k(size, step))

    def _bucket_wire_bytes(self, bucket):
        return sum(self._tensor_wire_bytes(size) for size in bucket.sizes)

    def get_config(self):
        return {**super().get_config(), "ratio": self.ratio, "momentum": self.momentum,
                "momentum_masking": self.momentum_masking, "warmup_steps": self.warmup_steps,
                "warmup_start": self.warmup_start, "dense_below": self.dense_below,
                "union": self.union, "adam_momentum_carry": self.adam_momentum_carry}


class ThresholdAggregator(Aggregator):
    """Sends the entries with `|value| >= threshold`; how many is decided per step.

    All replicas first all-gather their counts (4 bytes each), then pad their pairs to the
    largest count, so the bytes on the wire vary per step (read them from `comm_stats()`).

    Args:
        threshold: magnitude threshold, compared with this replica's error-corrected
            gradient (which Keras has already divided by the number of replicas);
            default 1e-4, the trainer's `--threshold`.
        **kwargs: see `Aggregator`.
    """

    lossy = True

    # The trainer's `--threshold` default: 1e-3 ended ~10 % above fp32 with Adam on an
    # embedding + LSTM model where 1e-4 ended +2.7 % (docs/guides/compression.md).
    def __init__(self, threshold=THRESHOLD, **kwargs):
        if not threshold > 0:
            raise ValueError(f"threshold={threshold!r} is invalid: must be > 0")
        super().__init__(**kwargs)
        self.threshold = float(threshold)

    def _exchange_bucket(self, flat, bucket):
        n = flat.shape[0]
        values, indices = codecs.threshold(flat, self.threshold)
        count = tf.size(indices, out_type=tf.int32)
        counts, count_bytes = collectives.gather_rows(count[None], self.collective_options)
        # At least one pair, so the gather never has an empty buffer.
        width = tf.maximum(tf.reduce_max(counts), 1)
        pad = [[0, width - count]]
        words = codecs.pack_sparse(tf.pad(values, pad), tf.pad(indices, pad))
        rows, nbytes = collectives.gather_rows(words, self.collective_options)
        return _sum_gathered(rows, n), codecs.densify(values, indices, n), count_bytes + nbytes

    def _bucket_wire_bytes(self, bucket):
        return 4  # data dependent: before the first step only the count is known

    def get_config(self):
        return {**super().get_config(), "threshold": self.threshold}
