"""ZeRO-3's gradient reduce-scatter in fp16, bf16 or int8 (`--zero_stage=3
--compression=fp16|bf16|int8`; ZeRO++'s quantized gradient reduce-scatter, qgZ).

Without a codec DTensor reduces ZeRO-3's gradients itself, in fp32, inside the backward
pass (`tfpar.zero.fsdp`: the gradient of each layer's weight gather). With one, the step
forms each data-parallel replica's own gradient first, as the mesh's codecs do
(`tfpar.layout.reduction`: `tf.vectorized_map` over the batch reshaped
`[data_parallel, m, ...]`, the gathers' gradients left whole by
`fsdp.per_replica_gradients`): a `[data_parallel, *shape]` tensor, row r on replica r.
`ShardedReduction.mean` then sends each row in the codec and leaves on each device the
mean of its own piece only:

- a weight split over `batch` (its axis `a`): each replica's gradient is cut into blocks
  (int8: one fp32 scale per index of axis `a`, the maximum over the weight's other axes,
  as `fsdp`'s int8 gather scales; a 1-D weight one scale per destination piece), the
  codes moved so that each device receives every replica's codes of its own piece (a
  relayout from split on the replica axis to split on axis `a`: an all-to-all), decoded
  and summed in fp32 on the device that owns the piece;
- a weight kept whole (no axis divides by the replicas, e.g. a small bias): each
  replica's codes gathered (int8: one scale per replica and tensor) and summed after
  decoding on every device.

With tensor parallelism (a weight also split over `model`) no reshape merges a dimension
split over `model`: each device codes its own `model` shard (`_reduce_model_split`), the
blocks laid out `[replicas, destination, piece rows, *other dimensions]` and moved by an
all-to-all over `batch` only; int8 takes one scale per row (its maximum over the row's
`model` shards, a max-reduce of one float a row) and packs the codes four rows to a word.

Error feedback (`error_feedback=True`, the default of `--error_feedback`): each replica
keeps what its message dropped, a DVariable `[data_parallel, *shape]` split on the
replica axis, added to its next gradient (`tfpar.compression.error_feedback`), as
ZeRO-1/2's `zero_residual` does. It costs each device one whole gradient's worth of
memory, and so does the per-replica gradient itself (the fp32 path reduces layer by
layer instead): `--error_feedback=false` drops the first.

`comm_stats` counts what each device hands to these collectives per step (its `model`
shard of each gradient): int8 one byte per entry (padded to whole 4-byte words: the
all-to-all moves int32) and 4 per scale, fp16/bf16 2 per entry.
"""

import math

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import compat
from tfpar.compression import codecs, error_feedback
from tfpar.layout import reduction, values
from tfpar.layout.mesh import BATCH, axis_size

CODECS = compat.ZERO_CODECS
_CAST = {"fp16": tf.float16, "bf16": tf.bfloat16}


class ShardedReduction:
    """Each replica's gradient reduce-scattered onto ZeRO-3's pieces through a codec.

    The interface of `tfpar.layout.reduction.BatchAxisReduction` (`read`, `mean`,
    `variables`, `comm_stats`), which the mesh step calls the same way.

    Args:
        mesh: the `keras.distribution.DeviceMesh`.
        variables: the trainable Keras variables (DVariables, split over `batch` by
            `tfpar.layout.variables.weights_over_batch`, or whole).
        codec: one of `CODECS`.
        error_feedback: keep each replica's dropped part for its next step.

    Raises:
        ConfigError: a codec not in `CODECS` (the rulebook's `ZERO3_COMPRESSION`).
    """

    def __init__(self, mesh, variables, codec, error_feedback=True):
        compat.enforce(compat.ZERO3_COMPRESSION,
                       compat.view(backend="dtensor", zero_stage=3, compression=codec))
        if codec not in CODECS:  # "none" passes the rulebook's row: no codec to run here
            raise ValueError(f"codec={codec!r}: ShardedReduction runs one of {CODECS}; "
                             "without a codec DTensor's own reduction runs")
        self.mesh, self.codec = mesh, codec
        self.paths = [v.path for v in variables]  # the state's names in checkpoints
        self.replicas = axis_size(mesh, BATCH)
        self.shapes = [tuple(int(d) for d in v.shape) for v in variables]
        # Per variable, taken eagerly (see BatchAxisReduction): its own layout, the axis
        # split over `batch` (None: kept whole), and the specs with that axis whole.
        # `shards`: how many pieces its other mesh axes (`model`) cut it into.
        self.own, self.axes, self.whole, self.shards = [], [], [], []
        for variable in variables:
            layout = dtensor.fetch_layout(variable.value)
            specs = list(layout.sharding_specs)
            self.own.append(layout)
            self.axes.append(specs.index(BATCH) if BATCH in specs else None)
            self.whole.append([dtensor.UNSHARDED if s == BATCH else s for s in specs])
            self.shards.append(math.prod(layout.mesh.dim_size(s) for s in self.whole[-1]
                                         if s != dtensor.UNSHARDED))
        self.residuals = []
        if error_feedback:
            for i, shape in enumerate(self.shapes):
                zeros = values.to_mesh(tf.zeros((self.replicas,) + shape, tf.float32),
                                       self._layout([BATCH] + self.whole[i]))
                self.residuals.append(dtensor.DVariable(zeros, trainable=False))

    @property
    def variables(self):
        """The residuals (empty without error feedback)."""
        return list(self.residuals)

    def named_state(self):
        """`{name: (DVariable, per_replica)}` under layout-independent names, as
        `BatchAxisReduction.named_state`: `<weight path>/residual`, one row per `batch`
        replica (`tfpar.state` saves them as `codec/...`)."""
        return {f"{path}/residual": (r, True) for path, r in zip(self.paths, self.residuals)}

    @property
    def step_variables(self):
        """What a step reads and writes (`BatchAxisReduction.step_variables`): all."""
        return self.variables

    def read(self):
        return [v.read_value() for v in self.residuals]

    def _layout(self, specs):
        return dtensor.Layout(list(specs), self.mesh.backend_mesh)

    def _blocks(self, index):
        """`(rows, columns)` of the int8 blocks of tensor `index`: one scale a row."""
        shape, axis = self.shapes[index], self.axes[index]
        size = math.prod(shape)
        if axis is None:
            return 1, size
        if len(shape) == 1:
            return self.replicas, size // self.replicas
        return shape[axis], size // shape[axis]

    def _wire(self, index):
        """Bytes one device hands over for tensor `index` (its `model` shard's part)."""
        shape, axis, shards = self.shapes[index], self.axes[index], self.shards[index]
        size = math.prod(shape)
        if self.codec in _CAST:
            return 2 * size // shards
        if shards == 1:  # each row's codes padded to whole int32 words
            rows, columns = self._blocks(index)
            return rows * (4 * -(-columns // 4) + 4)
        if axis is None:  # int8 codes gathered as they are, one scale
            return size // shards + 4
        # Split over `model` too: codes packed along each piece's rows, one scale per row.
        rows = shape[axis]
        piece = rows // self.replicas
        return (self.replicas * 4 * -(-piece // 4) * (size // rows) // shards
                + 4 * rows)

    def comm_stats(self):
        """Bytes one device hands to the reduce-scatters (and the gathers of weights kept
        whole) per step, against fp32 (4 per entry; with tensor parallelism its `model`
        shard of each gradient): the same dict as
        `tfpar.compression.Aggregator.comm_stats`."""
        raw = 4 * sum(math.prod(s) // n for s, n in zip(self.shapes, self.shards))
        wire = sum(self._wire(i) for i in range(len(self.shapes)))
        return {"bytes_on_wire_per_step": wire, "bytes_uncompressed_per_step": raw,
                "compression_ratio": raw / wire}

    def mean(self, grads, state, scale=None, finite=None):
        """`(means, new_state)`: the mean over replicas of `grads` (each
        `[replicas, *shape]`, split on `batch`), each in its variable's own layout (its
        piece on each device); `state` is what `read()` gave, `new_state` the next
        residuals (write them to `variables`).

        With fp16 loss scaling `scale` is the loss scale the gradients carry and
        `finite` the step's decision (default: every entry of `grads` finite), as in
        `tfpar.layout.reduction.BatchAxisReduction.mean`: the codec sends unscaled
        gradients, the means come back scaled for the `LossScaleOptimizer`, and a
        skipped step (not finite) leaves the residuals as they were."""
        if len(grads) != len(self.shapes):
            raise ValueError(f"{len(grads)} gradients for {len(self.shapes)} variables")
        finite = reduction.step_finite(grads, scale, finite)
        means, kept = [], []
        for i, g in enumerate(grads):
            x = reduction.unscaled(dtensor.relayout(
                tf.cast(g, tf.float32), self._layout([BATCH] + self.whole[i])), scale, finite)
            if state:
                x = error_feedback.corrected(x, state[i])
            total, sent = self._reduce(x, i)
            mean = reduction.rescaled(total / self.replicas, scale, finite)
            means.append(tf.cast(dtensor.relayout(mean, self.own[i]), g.dtype))
            if state:
                kept.append(reduction.kept_if(finite, error_feedback.next_residual(x, sent),
                                              state[i]))
        return means, kept

    def _reduce(self, x, index):
        """`(sum over replicas in the variable's layout, each replica's decoded
        message)` for `x` = `[replicas, *shape]`."""
        if self.shards[index] > 1:
            return self._reduce_model_split(x, index)
        axis, shape = self.axes[index], self.shapes[index]
        # Blocks `[replicas, rows, columns]` with the split axis (if any) first.
        perm = list(range(len(shape)))
        if axis is not None:
            perm = [axis] + [d for d in perm if d != axis]
        moved = tf.transpose(x, [0] + [d + 1 for d in perm])
        rows, columns = self._blocks(index)
        blocks = dtensor.relayout(tf.reshape(moved, [self.replicas, rows, columns]),
                                  self._layout([BATCH, dtensor.UNSHARDED, dtensor.UNSHARDED]))
        # Where the codes go: each device every replica's rows of its piece (split
        # weights: an all-to-all), or every replica's whole message (an all-gather).
        target = self._layout([dtensor.UNSHARDED, BATCH if axis is not None
                               else dtensor.UNSHARDED, dtensor.UNSHARDED])
        if self.codec in _CAST:
            codes = tf.cast(blocks, _CAST[self.codec])
            decoded_own = tf.cast(codes, tf.float32)
            summed = tf.reduce_sum(tf.cast(dtensor.relayout(codes, target), tf.float32), 0)
        else:
            amax = tf.reduce_max(tf.abs(blocks), axis=2, keepdims=True)
            scale = tf.where(amax > 0, amax / codecs.INT8_MAX, tf.ones_like(amax))
            codes = tf.cast(tf.clip_by_value(tf.round(blocks / scale), -codecs.INT8_MAX,
                                             codecs.INT8_MAX), tf.int8)
            decoded_own = tf.cast(codes, tf.float32) * scale
            # The all-to-all moves no int8: the codes travel packed 4 to an int32 word
            # (shifts and masks: packed with tf.bitcast, the step crashed, SIGSEGV, TF 2.21).
            words = dtensor.relayout(_pack(codes), target)
            codes = _unpack(words, columns)
            scales = dtensor.relayout(scale, target)
            summed = tf.reduce_sum(tf.cast(codes, tf.float32) * scales, 0)
        inverse = [perm.index(d) for d in range(len(shape))]
        moved_shape = [shape[d] for d in perm]
        total = tf.transpose(tf.reshape(summed, moved_shape), inverse)
        sent = tf.transpose(tf.reshape(decoded_own, [self.replicas] + moved_shape),
                            [0] + [d + 1 for d in inverse])
        return total, sent


    def _reduce_model_split(self, x, index):
        """`_reduce` of a gradient also split over `model` (tensor parallelism): no reshape
        merges a dimension split over `model`, so each device codes and sends its own
        shard. Split weights go as `[replicas, destination, piece rows, *other dims]` (the
        destination's rows whole on every device, the other dimensions split as the
        weight), moved by an all-to-all over `batch` only; int8 takes one scale per row
        (its maximum over the `model` shards: a max-reduce of one float a row) and packs
        the codes four rows to an int32 word. Weights kept whole over `batch` are
        gathered over it (int8 codes as they are, one scale per replica)."""
        axis, shape = self.axes[index], self.shapes[index]
        specs = self.whole[index]
        if axis is None:
            return self._gather_model_split(x, index)
        n, rest = len(shape), [d for d in range(len(shape)) if d != axis]
        piece = shape[axis] // self.replicas
        # [replicas, destination, piece, *rest]: only the unsplit row axis is reshaped.
        moved = tf.transpose(x, [0, axis + 1] + [d + 1 for d in rest])
        blocks = tf.reshape(moved, [self.replicas, self.replicas, piece]
                            + [shape[d] for d in rest])
        rest_specs = [specs[d] for d in rest]
        blocks = dtensor.relayout(blocks, self._layout(
            [BATCH, dtensor.UNSHARDED, dtensor.UNSHARDED] + rest_specs))
        target = self._layout([dtensor.UNSHARDED, BATCH, dtensor.UNSHARDED] + rest_specs)
        if self.codec in _CAST:
            codes = tf.cast(blocks, _CAST[self.codec])
            decoded_own = tf.cast(codes, tf.float32)
            summed = tf.reduce_sum(tf.cast(dtensor.relayout(codes, target), tf.float32), 0)
        else:
            others = list(range(3, 3 + len(rest)))
            amax = tf.reduce_max(tf.abs(blocks), axis=others, keepdims=True)
            scale = tf.where(amax > 0, amax / codecs.INT8_MAX, tf.ones_like(amax))
            codes = tf.cast(tf.clip_by_value(tf.round(blocks / scale), -codecs.INT8_MAX,
                                             codecs.INT8_MAX), tf.int8)
            decoded_own = tf.cast(codes, tf.float32) * scale
            # Packed along the piece's rows (last), the one axis unsplit on both sides.
            last = [0, 1] + others + [2]
            words = dtensor.relayout(_pack(tf.transpose(codes, last)), self._layout(
                [dtensor.UNSHARDED, BATCH] + rest_specs + [dtensor.UNSHARDED]))
            back = [0, 1, len(last) - 1] + list(range(2, len(last) - 1))
            received = tf.transpose(_unpack(words, piece), back)
            summed = tf.reduce_sum(tf.cast(received, tf.float32)
                                   * dtensor.relayout(scale, self._layout(
                                       [dtensor.UNSHARDED, BATCH, dtensor.UNSHARDED]
                                       + [dtensor.UNSHARDED] * len(rest))), 0)
        inverse = [([axis] + rest).index(d) for d in range(n)]
        total = tf.transpose(tf.reshape(summed, [shape[axis]] + [shape[d] for d in rest]),
                             inverse)
        sent = tf.transpose(tf.reshape(decoded_own, [self.replicas, shape[axis]]
                                       + [shape[d] for d in rest]),
                            [0] + [d + 1 for d in inverse])
        return total, sent

    def _gather_model_split(self, x, index):
        """`_reduce_model_split` of a weight kept whole over `batch`: each replica's
        codes of its `model` shard gathered over `batch`, summed after decoding."""
        target = self._layout([dtensor.UNSHARDED] + self.whole[index])
        if self.codec in _CAST:
            codes = tf.cast(x, _CAST[self.codec])
            summed = tf.reduce_sum(tf.cast(dtensor.relayout(codes, target), tf.float32), 0)
            return summed, tf.cast(codes, tf.float32)
        amax = tf.reduce_max(tf.abs(x), axis=list(range(1, x.shape.rank)), keepdims=True)
        scale = tf.where(amax > 0, amax / codecs.INT8_MAX, tf.ones_like(amax))
        codes = tf.cast(tf.clip_by_value(tf.round(x / scale), -codecs.INT8_MAX,
                                         codecs.INT8_MAX), tf.int8)
        scales = dtensor.relayout(scale, self._layout([dtensor.UNSHARDED] * x.shape.rank))
        summed = tf.reduce_sum(tf.cast(dtensor.relayout(codes, target), tf.float32)
                               * scales, 0)
        return summed, tf.cast(codes, tf.float32) * scale


def _pack(codes):
    """int8 `[..., n]` as int32 `[..., ceil(n / 4)]`, code j of a word in its byte j."""
    n = int(codes.shape[-1])
    padded = tf.pad(tf.cast(codes, tf.int32), [[0, 0]] * (codes.shape.rank - 1)
                    + [[0, (-n) % 4]])
    parts = tf.reshape(padded, padded.shape[:-1] + [-(-n // 4), 4])
    words = tf.bitwise.bitwise_and(parts[..., 0], 0xFF)
    for j in (1, 2, 3):
        words = tf.bitwise.bitwise_or(words, tf.bitwise.left_shift(
            tf.bitwise.bitwise_and(parts[..., j], 0xFF), 8 * j))
    return words


def _unpack(words, n):
    """Inverse of `_pack`: the first `n` codes, as int32 `[..., n]` (sign kept by the
    arithmetic right shift)."""
    parts = [tf.bitwise.right_shift(tf.bitwise.left_shift(words, 24 - 8 * j), 24)
             for j in range(4)]
    codes = tf.stack(parts, -1)
    return tf.reshape(codes, words.shape[:-1] + [4 * int(words.shape[-1])])[..., :n]
