"""The data-parallel gradient reduction of a mesh step, optionally compressed.

On a mesh DTensor sums the gradients over the `batch` axis implicitly, inside the backward
pass, in fp32. To compress that sum, the step instead forms each data-parallel replica's
own gradient: `tf.vectorized_map` over the batch reshaped to `[data_parallel, m, ...]`
(split on `batch`) gives gradients `[data_parallel, *shape]` laid out
`(batch, *the variable's layout)` — no sum over `batch` has happened yet, while the
collectives inside the `model` axis (tensor parallelism's own) ran exactly as before.
`BatchAxisReduction.mean` then sums over the `batch` axis through the codec:

- `none`: an fp32 mean (the reference; equal to the implicit sum up to re-association),
- `fp16` / `bf16`: the replicas' values cast to 16 bits and summed in 16 bits: the
  all-reduce over `batch` moves half the bytes,
- `int8`: one scale per replica and tensor (its max over the `model` shards is an exact
  max-reduce), the int8 codes all-gathered over `batch` (a quarter of fp32) and summed
  after decoding on every device,
- `lowbit`: each replica's row (its `model` shards together) in `lowbit_bits` bits per
  entry and one fp32 scale per 256 entries (`tfpar.compression.lowbit`'s `encode`, packed
  into int32 words), words and scales all-gathered over `batch` and summed after decoding
  in replica order on every device (~0.1× fp32's bytes at 3 bits),
- `topk`: each replica's `ratio` largest-magnitude entries of each tensor (picked over the
  whole tensor, its `model` shards together, as `tfpar.compression.TopKAggregator` picks
  them); with `union` (the default) the indices are all-gathered over `batch` and every
  replica's values at their union all-reduced, else the (value, index) pairs gathered.
  Tensors whose message would be no smaller go whole, by the same rule,
- `threshold`: the entries with `|value| >= threshold` kept, the rest left to error
  feedback; the masked gradient is summed densely (a data-dependent message length is
  not built on the mesh), so it saves no bytes here,
- `powersgd`: matrices as rank-r factors (`tfpar.compression.powersgd`): `P = M Q` summed
  over `batch`, orthogonalised, `Q = Mᵀ P̂` summed, `Q` kept (replicated) to warm-start
  the next step; vectors and matrices too small to gain sent whole.

With fp16 loss scaling the gradients are unscaled before the codec and a step that
overflowed on any device leaves the codec's state untouched (`mean`'s `scale`, `finite`);
with accumulation the replicas' micro-batch gradients are averaged first and the codec
runs once a step (`tfpar.layout.step`).

With Adam (`codec_options`'s `adam_front`, the trainer's `--compress_adam_step`) top-k,
PowerSGD and lowbit take Adam in front of them, as on tf.distribute:
`tfpar.layout.adam_front.AdamFrontReduction`, through `mean`'s hooks.

Error feedback (`error_feedback=True`, lossy codecs): each replica keeps what its message
dropped, a DVariable `[data_parallel, *shape]` sharded like its gradient, and adds it to the
next step's gradient (`tfpar.compression.error_feedback`). PowerSGD's residual is, as on
tf.distribute, the corrected gradient minus the replica's share of the summed approximation.
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import compat
from tfpar.compression import auto, codecs, error_feedback, lowbit, powersgd
from tfpar.compression.sparse import TopKAggregator
from tfpar.config import ADAM_FRONT_CODECS, LOWBIT_BITS
from tfpar.layout import values
from tfpar.layout.mesh import batch_axis, batch_parts

CODECS = ("none", "fp16", "bf16", "int8", "lowbit", "topk", "threshold", "powersgd", "auto")
# `auto`'s parameters in `codec_options` (`tfpar.layout.auto.AutoReduction` takes them),
# and Adam in front's (`tfpar.layout.adam_front.AdamFrontReduction`).
_AUTO_OPTIONS = ("budget_ms", "link")
_ADAM_OPTIONS = ("adam_front", "adam_warmup_steps", "adam_variance", "topk_momentum_carry")
_CAST = {"fp16": tf.float16, "bf16": tf.bfloat16}


def codec_options(config):
    """The codec parameters of a `ParallelConfig` that `BatchAxisReduction` takes."""
    link = auto.link_of(config.auto_link_mbps, config.auto_link_latency_ms)
    return {"topk_ratio": config.topk_ratio, "topk_union": config.topk_union,
            "topk_dense_below": config.topk_dense_below, "threshold": config.threshold,
            "powersgd_rank": config.powersgd_rank, "lowbit_bits": config.lowbit_bits,
            "seed": config.seed, "budget_ms": config.auto_budget_ms, "link": link,
            # Adam in front of top-k, PowerSGD and lowbit, as tf.distribute puts it
            # (`tfpar.compression.make_aggregator`; docs/guides/compression.md).
            "adam_front": (config.compress_adam_step and config.optimizer == "adam"
                           and config.compression in ADAM_FRONT_CODECS),
            "adam_warmup_steps": config.adam_warmup_steps,
            "topk_momentum_carry": config.topk_momentum_carry}


def for_codec(mesh, variables, codec, error_feedback=True, optimizer=None, **options):
    """The reduction over `batch` of `codec`: `auto`'s (`tfpar.layout.auto`), with
    `options["adam_front"]` and the run's `optimizer` Adam in front of it
    (`tfpar.layout.adam_front`, which switches `optimizer` to apply its steps), or a
    `BatchAxisReduction`; `options` as `codec_options` (or `codec_of`) gives them. Without
    `optimizer` Adam stays behind the codec."""
    adam = {k: options.pop(k) for k in _ADAM_OPTIONS if k in options}
    if codec == "auto":
        from tfpar.layout.auto import AutoReduction
        return AutoReduction(mesh, variables, error_feedback, **options)
    options = {k: v for k, v in options.items() if k not in _AUTO_OPTIONS}
    if adam.pop("adam_front", False) and optimizer is not None:
        from tfpar.layout.adam_front import AdamFrontReduction
        return AdamFrontReduction(mesh, variables, codec, error_feedback, optimizer,
                                  **adam, **options)
    return BatchAxisReduction(mesh, variables, codec, error_feedback, **options)


def distinct_paths(variables):
    """The variables' Keras paths, a repeated one (two nested models' Dense "proj":
    `proj/kernel` twice) made `path#2`, `path#3`, ... in their order: the names of their
    codec state in checkpoints and Keras's files, where a repeat let one weight's state
    overwrite another's."""
    seen, out = {}, []
    for variable in variables:
        seen[variable.path] = seen.get(variable.path, 0) + 1
        count = seen[variable.path]
        out.append(variable.path if count == 1 else f"{variable.path}#{count}")
    return out


class BatchAxisReduction:
    """Averages per-replica gradients over the mesh's `batch` axis through a codec.

    Args:
        mesh: the `keras.distribution.DeviceMesh`.
        variables: the trainable Keras variables (DVariables) the gradients belong to.
        codec: one of `CODECS`.
        error_feedback: keep each replica's dropped part for the next step (lossy codecs).
        topk_ratio, topk_union, topk_dense_below: top-k's density, whether the replicas
            send their values at the union of their indices, and the size at or below
            which a tensor goes whole (`ParallelConfig`'s fields of the same names).
        threshold: the threshold codec's magnitude.
        powersgd_rank, seed: PowerSGD's rank, and the seed of its initial `Q`s.
        lowbit_bits: lowbit's bits per entry (1-4, `--lowbit_bits`).

    Raises:
        ValueError: an unknown codec (`auto` is `tfpar.layout.auto.AutoReduction`, made by
            `for_codec`).
    """

    def __init__(self, mesh, variables, codec="none", error_feedback=True, topk_ratio=0.25,
                 topk_union=True, topk_dense_below=1024, threshold=1e-4, powersgd_rank=16,
                 lowbit_bits=LOWBIT_BITS, seed=0):
        if codec not in CODECS:
            raise ValueError(f"codec={codec!r} is invalid: use one of {', '.join(CODECS)}")
        self.mesh, self.codec = mesh, codec
        self.replicas = batch_parts(mesh)
        axis = batch_axis(mesh)  # "batch", or keras.distribution's first axis ("data")
        self.paths = distinct_paths(variables)  # the state's names in checkpoints
        self.shapes = [tuple(int(d) for d in v.shape) for v in variables]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.threshold, self.rank = float(threshold), int(powersgd_rank)
        self.bits = int(lowbit_bits)
        # Top-k's k per tensor by `TopKAggregator`'s rule (one policy for both backends).
        self.topk = TopKAggregator(topk_ratio, dense_below=topk_dense_below,
                                   union=topk_union, error_feedback=error_feedback)
        # Layouts are taken here, eagerly: inside the traced step DTensor cannot fetch one
        # (`fetch_layout` must be called eagerly). Per variable: its gradient stacked over
        # replicas `(batch, *layout)`, the same gathered over `batch`, and its own.
        self.stacked, self.gathered, self.own = [], [], []
        for variable in variables:
            layout = dtensor.fetch_layout(variable.value)
            specs = list(layout.sharding_specs)
            self.own.append(layout)
            self.stacked.append(dtensor.Layout([axis] + specs, layout.mesh))
            self.gathered.append(dtensor.Layout([dtensor.UNSHARDED] + specs, layout.mesh))
        self._rows = dtensor.Layout([axis, dtensor.UNSHARDED], mesh.backend_mesh)
        self.residuals = []
        if codec != "none" and error_feedback:
            for variable, stacked in zip(variables, self.stacked):
                zeros = values.to_mesh(
                    tf.zeros((self.replicas,) + tuple(variable.shape), tf.float32), stacked)
                self.residuals.append(dtensor.DVariable(zeros, trainable=False))
        # PowerSGD's warm-started `Q` per matrix, the same on every device (replicated).
        self.qs = {}
        if codec == "powersgd":
            for i, shape in enumerate(self.shapes):
                if powersgd.compressible(shape, self.rank):
                    q = powersgd.initial_q(powersgd.matrix_shape(shape)[1],
                                           powersgd.effective_rank(shape, self.rank), seed + i)
                    self.qs[i] = dtensor.DVariable(values.to_mesh(q, dtensor.Layout.replicated(
                        mesh.backend_mesh, 2)), trainable=False)

    def topk_k(self, index):
        """Entries top-k sends of tensor `index`; its size when it goes whole (at most
        `dense_below` entries, or a sparse message no smaller than its values)."""
        size = self.sizes[index]
        k = self.topk.k(size)
        sparse = 4 * k + 4 * k * self.replicas if self.topk.union else 8 * k
        return size if sparse >= 4 * size else k

    def _wire(self, index):
        """Bytes one replica hands to the `batch` collectives for tensor `index`."""
        size = self.sizes[index]
        if self.codec == "int8":
            return size + 4
        if self.codec == "lowbit":
            return 4 * (self.bits * lowbit.words_per_plane(size)
                        + lowbit.block_count([size], lowbit.BLOCK))
        if self.codec in _CAST:
            return 2 * size
        if self.codec == "topk":
            k = self.topk_k(index)
            if k == size:
                return 4 * size
            return 4 * k + 4 * k * self.replicas if self.topk.union else 8 * k
        if self.codec == "powersgd" and index in self.qs:
            n, m = powersgd.matrix_shape(self.shapes[index])
            return 4 * (n + m) * powersgd.effective_rank(self.shapes[index], self.rank)
        return 4 * size  # none, threshold (summed densely), tensors sent whole

    def comm_stats(self):
        """Bytes one replica (a position on `batch`, all its `model` shards together) hands
        to the `batch` axis's collectives per step, against fp32: fp16/bf16 2 per entry,
        int8 1 per entry and a 4-byte scale per tensor, lowbit its int32 code words and
        a 4-byte scale per 256 entries, top-k its indices and values,
        PowerSGD its two factors, `none` and `threshold` 4 per entry. Static: the message
        sizes do not change from step to step.

        Returns:
            `{"bytes_on_wire_per_step": int, "bytes_uncompressed_per_step": int,
            "compression_ratio": float}`, as `tfpar.compression.Aggregator.comm_stats`.
        """
        raw = 4 * sum(self.sizes)
        wire = sum(self._wire(i) for i in range(len(self.sizes)))
        return {"bytes_on_wire_per_step": wire, "bytes_uncompressed_per_step": raw,
                "compression_ratio": raw / wire}

    @property
    def variables(self):
        """The state DVariables, as `read()` orders them: the residuals (empty without
        error feedback), then PowerSGD's `Q`s. Named in checkpoints as aggregator state."""
        return list(self.residuals) + [self.qs[i] for i in sorted(self.qs)]

    def named_state(self):
        """`{name: (DVariable, per_replica)}` of the state under names that do not depend
        on the layout (`tfpar.state`): `<weight path>/residual` (`[replicas, *shape]`, one
        row per `batch` replica: `per_replica`) and `<weight path>/powersgd_q`."""
        out = {}
        if self.residuals:
            out.update({f"{path}/residual": (r, True)
                        for path, r in zip(self.paths, self.residuals)})
        out.update({f"{self.paths[i]}/powersgd_q": (q, False) for i, q in self.qs.items()})
        return out

    @property
    def step_variables(self):
        """The state a step reads (`read()`) and writes (`mean`'s new state), in that
        order: `variables` (a subclass may keep some of its state out of the step's
        hands: `tfpar.layout.adam_front`'s warm-up copies)."""
        return self.variables

    def read(self):
        return [v.read_value() for v in self.step_variables]

    def mean(self, grads, state, scale=None, finite=None):
        """`(means, new_state)`: the mean over replicas of `grads` (each
        `[replicas, *shape]`, split on `batch`) through the codec; `state` is what `read()`
        gave, `new_state` its next values in the same order (write them to
        `step_variables`).

        With fp16 loss scaling, `scale` is the loss scale the gradients carry (a scalar on
        this mesh): they are unscaled before the codec, so residuals and `Q`s hold plain
        gradients whatever the scale, and the means are scaled back (a power of two: exact)
        for the `LossScaleOptimizer`, which checks and unscales them. `finite` (a boolean
        scalar on this mesh; default: whether every entry of `grads` is finite) decides
        the step: when false the codec's output is discarded (it encoded only the
        residuals), `new_state` is `state` unchanged and the means are not finite, so the
        optimizer skips the update and lowers its scale.
        """
        if len(grads) != len(self.stacked):
            raise ValueError(f"{len(grads)} gradients for {len(self.stacked)} variables")
        residuals = list(state[:len(self.residuals)])
        finite = step_finite(grads, scale, finite)
        step = self._begin(state[len(self.residuals):])
        step["finite"] = finite  # (a subclass writing state inside a branch keeps it so)
        means, kept = [], []
        for i, g in enumerate(grads):
            # Pin each replica's gradient to its own shard (a no-op when DTensor already
            # placed it so): nothing over `batch` is summed before the codec.
            x = unscaled(dtensor.relayout(tf.cast(g, tf.float32), self.stacked[i]),
                         scale, finite)
            mean, residual = self._mean_one(i, x, residuals[i] if residuals else None, step)
            means.append(tf.cast(rescaled(mean, scale, finite), g.dtype))
            if residuals:
                kept.append(kept_if(finite, residual, residuals[i]))
        return means, kept + self._end(step, finite)

    # The codec's own state through `mean` (a subclass's too: `tfpar.layout.auto`,
    # `tfpar.layout.adam_front`): `_begin` reads it from `mean`'s state after the
    # residuals, `_mean_one` averages one gradient (error feedback around `_reduce`, which
    # sums it) and notes its next values, `_end` returns them (as `kept_if` keeps them).
    def _begin(self, state):
        return {"qs": dict(zip(sorted(self.qs), state)), "new_qs": {}}

    def _mean_one(self, i, x, residual, step):
        """`(mean over replicas, next residual or None)` of gradient `i` (`[replicas,
        *shape]`, unscaled), with error feedback around the codec when `residual` is given."""
        if residual is None:
            total, _ = self._reduce(i, x, step)
            return total / self.replicas, None
        x = error_feedback.corrected(x, residual)
        total, sent = self._reduce(i, x, step)
        return total / self.replicas, error_feedback.next_residual(x, sent)

    def _reduce(self, i, x, step):
        """`(sum over axis 0, what each replica's message decodes to)` of gradient `i`."""
        if i not in step["qs"]:
            return self._sum(x, i)
        q = step["qs"][i]
        total, sent, q_sum = self._powersgd(x, q)
        step["new_qs"][i] = powersgd.nonzero_or(q_sum, dtensor.relayout(q, self._replicated(2)))
        return total, sent

    def _end(self, step, finite):
        return [kept_if(finite, step["new_qs"][i], step["qs"][i]) for i in sorted(step["qs"])]

    def _sum(self, x, index):
        """`(sum over axis 0, what each replica's message decodes to)` for the gradient
        of variable `index`."""
        if self.codec == "none":
            return tf.reduce_sum(x, 0), x
        if self.codec in _CAST:
            sent = tf.cast(x, _CAST[self.codec])
            return tf.cast(tf.reduce_sum(sent, 0), tf.float32), tf.cast(sent, tf.float32)
        if self.codec == "topk":
            return self._topk(x, index)
        if self.codec == "lowbit":
            return self._lowbit(x, index)
        if self.codec == "threshold":
            sent = tf.where(tf.abs(x) >= self.threshold, x, tf.zeros_like(x))
            return tf.reduce_sum(sent, 0), sent
        if self.codec == "powersgd":  # a vector or a matrix too small to gain: whole
            return tf.reduce_sum(x, 0), x
        # int8: one scale per replica, codes gathered over `batch`, summed after decoding.
        dims = list(range(1, x.shape.rank))
        amax = tf.reduce_max(tf.abs(x), axis=dims, keepdims=True)
        scale = tf.where(amax > 0, amax / codecs.INT8_MAX, tf.ones_like(amax))
        codes = tf.cast(tf.clip_by_value(tf.round(x / scale), -codecs.INT8_MAX,
                                         codecs.INT8_MAX), tf.int8)
        gathered = dtensor.relayout(codes, self.gathered[index])
        scales = dtensor.relayout(scale, self._replicated(scale.shape.rank))
        decoded = tf.cast(gathered, tf.float32) * scales
        summed = tf.add_n(tf.unstack(decoded, num=self.replicas))
        return summed, tf.cast(codes, tf.float32) * scale

    def _densify(self, values, indices, n):
        """`codecs.densify`, its inputs and output whole on every device: DTensor's scatter
        would otherwise place global indices into one shard."""
        return dtensor.relayout(codecs.densify(values, indices, n), self._replicated(1))

    def _replicated(self, rank):
        return dtensor.Layout.replicated(self.mesh.backend_mesh, rank)

    def _topk(self, x, index):
        """Top-k over `batch`: each replica's k largest entries (`codecs.topk`'s choice),
        their indices gathered; with the union, every replica's values at the union's
        positions summed (as `tfpar.compression.sparse.union_sum`), else the pairs gathered
        and scattered in replica order."""
        n, k = self.sizes[index], self.topk_k(index)
        if k == n:
            return tf.reduce_sum(x, 0), x
        # Each replica's row whole (its `model` shards together), split on `batch`.
        flat = dtensor.relayout(tf.reshape(x, [self.replicas, n]), self._rows)
        _, indices = tf.math.top_k(tf.abs(flat), k=k, sorted=False)
        indices = dtensor.relayout(indices, self._replicated(2))  # the all-gather
        if self.topk.union:
            order = tf.sort(tf.reshape(indices, [-1]))
            first = tf.concat([[True], order[1:] != order[:-1]], 0)
            mine = tf.where(first, tf.gather(flat, order, axis=1), tf.zeros_like(flat[:, :1]))
            summed = dtensor.relayout(tf.reduce_sum(mine, 0), self._replicated(1))  # all-reduce
            total = self._densify(summed, order, n)
            sent = flat * self._densify(tf.cast(first, tf.float32), order, n)  # 0/1: the union
        else:
            picked = tf.gather(flat, indices, axis=1, batch_dims=1)
            picked = dtensor.relayout(picked, self._replicated(2))  # the all-gather
            rows = [self._densify(v, i, n) for v, i in zip(
                tf.unstack(picked, num=self.replicas), tf.unstack(indices, num=self.replicas))]
            total, sent = tf.add_n(rows), tf.stack(rows)  # in replica order
        shape = (self.replicas,) + self.shapes[index]
        return (dtensor.relayout(tf.reshape(total, shape[1:]), self.own[index]),
                dtensor.relayout(tf.reshape(sent, shape), self.stacked[index]))

    def _lowbit(self, x, index):
        """Lowbit over `batch`: each replica's row coded by `lowbit.encode` (blocks of 256
        entries of this tensor), code words and scales all-gathered (int32 and fp32: DTensor
        moves neither as int8) and decoded on every device, summed in replica order."""
        n, shape = self.sizes[index], self.shapes[index]
        ids, count = lowbit.block_ids([n], lowbit.BLOCK), lowbit.block_count([n], lowbit.BLOCK)
        # Each replica's row whole (its `model` shards together), split on `batch`.
        flat = dtensor.relayout(tf.reshape(x, [self.replicas, n]), self._rows)
        words, scales = lowbit.encode(flat, ids, count, self.bits, lowbit.BLOCK)
        all_words = dtensor.relayout(words, self._replicated(2))  # the all-gathers
        all_scales = dtensor.relayout(scales, self._replicated(2))
        decoded = lowbit.decode(all_words, all_scales, ids, n, self.bits)
        total = tf.add_n(tf.unstack(decoded, num=self.replicas))  # in replica order
        sent = lowbit.decode(words, scales, ids, n, self.bits)
        return (dtensor.relayout(tf.reshape(total, shape), self.own[index]),
                dtensor.relayout(tf.reshape(sent, (self.replicas,) + shape),
                                 self.stacked[index]))

    def _powersgd(self, x, q):
        """`(sum, each replica's share of it, summed Q)`: one PowerSGD round over `batch`
        at `q`'s rank (`tfpar.compression.powersgd`); the residual is formed against the
        replica's share of the summed approximation, as `PowerSGDAggregator` forms it."""
        shape = x.shape[1:]
        m = tf.reshape(x, (self.replicas,) + powersgd.matrix_shape(shape))
        q = dtensor.relayout(q, self._replicated(2))
        # The sums over `batch` (the all-reduces) whole on every device: DTensor has no
        # sharded QR.
        p_sum = tf.reduce_sum(powersgd.compress_p(m, q), 0)
        p_hat = powersgd.orthogonalize(dtensor.relayout(p_sum, self._replicated(2)))
        # `compress_q` per replica: Mᵣᵀ P̂, batched over `batch`, then summed over it.
        q_sum = tf.reduce_sum(tf.einsum("rnm,nk->rmk", m, p_hat), 0)
        q_sum = dtensor.relayout(q_sum, self._replicated(2))
        total = tf.reshape(powersgd.decompress(p_hat, q_sum), shape)
        share = tf.broadcast_to(total / self.replicas, x.shape)
        return total, share, q_sum


# A codec's step under fp16 loss scaling, shared by every reduction of a mesh step (this
# module's and ZeRO-3's `tfpar.zero.reduce_scatter`): `step_finite` decides the step once,
# `unscaled` feeds the codec plain gradients (zeros on a skipped step: it then encodes only
# the residuals), `rescaled` hands the optimizer its scaled mean (not finite when skipped),
# `kept_if` keeps the codec's state as it was on a skipped step.
def step_finite(grads, scale, finite=None):
    """The step's decision: `finite` if given, else with a `scale` whether every entry of
    `grads` is finite, else None (no loss scaling: nothing to decide)."""
    if scale is not None and finite is None:
        return all_finite(grads)
    return finite


def unscaled(x, scale, finite):
    """`x / scale` (fp32), or zeros where the step is skipped; `x` without a `scale`."""
    if scale is None:
        return x
    return where_scalar(finite, x / tf.cast(scale, tf.float32), tf.zeros_like(x))


def rescaled(mean, scale, finite):
    """`mean * scale` (a power of two: exact) for the `LossScaleOptimizer`, which checks
    and unscales it; 0 / 0 (not finite: the optimizer skips) on a skipped step."""
    if scale is None:
        return mean
    return mean * tf.cast(scale, tf.float32) / tf.cast(finite, tf.float32)


def kept_if(finite, new, old):
    """The codec's next state `new`, or `old` unchanged on a skipped step."""
    return new if finite is None else where_scalar(finite, new, old)


def for_variables(mesh, variables, codec, error_feedback=True, options=None, optimizer=None):
    """The reduction that averages `variables`' per-replica gradients over the batch axis
    through `codec`: `BatchAxisReduction`, or for weights split over `batch` too (ZeRO-3)
    `tfpar.zero.reduce_scatter.ShardedReduction` (reduce-scattered onto the pieces); None
    with one replica on the batch axis (nothing to reduce: the `model` axis's collectives
    are never compressed, so the exact step runs).

    Args:
        mesh, variables, codec, error_feedback: as `BatchAxisReduction`'s.
        options: the codec's parameters (`codec_options(config)`, `codec_of`), or None for
            `BatchAxisReduction`'s defaults.
        optimizer: the run's optimizer, for Adam in front of the codec (`for_codec`).
    """
    from tfpar.zero import fsdp, reduce_scatter  # reduce_scatter imports tfpar.layout
    if batch_parts(mesh) == 1:
        return None
    if fsdp.split_over_batch(variables):
        return reduce_scatter.ShardedReduction(mesh, variables, codec, error_feedback)
    return for_codec(mesh, variables, codec, error_feedback, optimizer, **(options or {}))


def codec_of(aggregator):
    """`(codec, error_feedback, options)` of `for_variables` for a tfpar aggregator (a
    `tfpar.DistributedOptimizer`'s): its class as a codec of `CODECS`, its parameters as
    `BatchAxisReduction`'s (PowerSGD's rank and seed, top-k's ratio, union and dense
    size, threshold's magnitude, lowbit's bits); with Adam in front of top-k, PowerSGD or
    lowbit (`Aggregator.adam`, what `DistributedOptimizer` sets over Adam) its
    `adam_front` options: `adam_warmup_steps`, `adam_variance`, top-k's momentum carry.

    Raises:
        ConfigError: what the mesh does not run (`tfpar.compat`'s rows): `auto` or an
            aggregator of the user's own class, PowerSGD's `start_step`, top-k's
            `warmup_steps` or DGC `momentum`; Adam in front with `adam_warmup_steps=0`,
            `adam_variance="live"` or `adam_refresh_every>0`.
    """
    from tfpar import compression as lib
    kind = type(aggregator)
    names = {lib.NoneAggregator: "none", lib.Int8Aggregator: "int8",
             lib.LowBitAggregator: "lowbit", lib.TopKAggregator: "topk",
             lib.ThresholdAggregator: "threshold", lib.PowerSGDAggregator: "powersgd",
             lib.AutoAggregator: "auto"}
    codec = (aggregator.dtype_name if kind is lib.CastAggregator
             else names.get(kind, kind.__name__))
    adam = getattr(aggregator, "adam", None) is not None and codec in lib.ADAM_STEP_AGGREGATORS
    view = compat.view(backend="dtensor", compression=codec, keras_distribution=True,
                       powersgd_start_step=getattr(aggregator, "start_step", 0),
                       topk_warmup_steps=getattr(aggregator, "warmup_steps", 0),
                       topk_momentum=getattr(aggregator, "momentum", 0.0),
                       compress_adam_step=adam, adam_warmup_steps=aggregator.adam_warmup_steps,
                       adam_variance=aggregator.adam_variance if adam else "frozen",
                       adam_refresh_every=aggregator.adam_refresh_every if adam else 0)
    for rule in (compat.KERAS_MESH_AGGREGATOR_CODEC, compat.MESH_POWERSGD_START,
                 compat.MESH_TOPK_WARMUP, compat.MESH_TOPK_MOMENTUM, compat.MESH_ADAM_WARMUP,
                 compat.KERAS_MESH_ADAM_VARIANCE, compat.KERAS_MESH_ADAM_REFRESH):
        compat.enforce(rule, view)
    options = {}
    if codec == "powersgd":
        options = {"powersgd_rank": aggregator.rank, "seed": aggregator.seed}
    elif codec == "topk":
        options = {"topk_ratio": aggregator.ratio, "topk_union": aggregator.union,
                   "topk_dense_below": aggregator.dense_below}
    elif codec == "threshold":
        options = {"threshold": aggregator.threshold}
    elif codec == "lowbit":
        options = {"lowbit_bits": aggregator.bits}
    if adam:
        # Adam in front of the codec, as the aggregator holds it on tf.distribute (the
        # default of `DistributedOptimizer` over Adam): `for_codec` with the optimizer.
        options.update(adam_front=True, adam_warmup_steps=aggregator.adam_warmup_steps,
                       adam_variance=aggregator.adam_variance)
        if codec == "topk":
            options["topk_momentum_carry"] = aggregator.adam_momentum_carry
    return codec, aggregator.error_feedback, options


def all_finite(tensors):
    """Whether every entry of `tensors` is finite: a boolean scalar, the same on every
    device of their mesh (the check reduces over every shard)."""
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]))


def where_scalar(condition, a, b):
    """`tf.where` of a boolean scalar `condition` over tensors `a`, `b` of one shape; the
    condition shaped `[1] * rank` (DTensor crashed on a scalar condition, TF 2.21)."""
    return tf.where(tf.reshape(condition, [1] * a.shape.rank), a, b)
