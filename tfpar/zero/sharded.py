"""ZeRO stages 1 and 2 on `tf.distribute` data parallelism (`--zero_stage=1|2`).

The shard unit is a flat piece: every trainable variable is flattened into one fp32
vector of `T` elements, padded to `N * S` (`S = ceil(T / N)`, `N` replicas), and replica
`r` owns elements `[r*S, (r+1)*S)`. Equal pieces, not whole variables per owner: an
owner-per-variable split is as uneven as the largest variable (an mlp's first kernel is
over half its parameters), so the state per device would stay far above 1/N; equal pieces
give `S / T` of it, within padding (< N elements).

The optimizer's slots (SGD momentum, Adam's m and v) exist only as these pieces: one
`ON_READ` variable of shape `[S]` per slot, whose component on each replica's device holds
that replica's piece (Keras's full-size slots are never created). A step, in replica
context, after the backward pass:

1. the gradients, flattened and padded: stage 1 all-reduces them (every replica holds the
   full sum) and takes its piece; stage 2 reduce-scatters them (each replica receives only
   the sum of its own piece);
2. the replica updates its piece of the weights (read from its own copy of the mirrored
   weights) and of the slots with the optimizer's own formulas (`_sgd`, `_adam`, the same
   operations as Keras's `update_step`, element-wise, so a flat piece updates exactly as
   the shaped tensor would);
3. the updated pieces are all-gathered and every replica assigns the full vector back to
   its copy of each mirrored weight, so the weights stay mirrored for the forward pass.

The reduce-scatter and the gather run as TensorFlow collective ops on one group of all
replicas (`CollectiveAllToAllV2` plus a local sum, `CollectiveGatherV2`): the piece a
replica receives is its rank's; `check_ranks` verifies once that rank equals the replica
id that checkpoints order pieces by.

Adam with a sparse (`IndexedSlices`) gradient, an embedding's: Keras squares each slice
before summing them into `v`, so the update carries a second flat vector there, the
replica's summed squared slices, reduced like the gradient (see `_adam`).

With `--compression=fp16|bf16|int8` (ZeRO++'s quantized gradient reduce-scatter) both
stages reduce-scatter: each replica's pieces travel in the codec (`encode_pieces`: int8
with one fp32 scale per `INT8_BLOCK` entries of each piece) and their owner decodes and
sums them in fp32 (`reduce_scatter_encoded`); with error feedback each replica keeps what
its message dropped in `zero_residual` (the unpadded flat length). `--compression=
lowbit|topk` reduce-scatter the same way, each
piece coded for its owner by `tfpar.zero.piece_codecs`. `--compression=threshold|powersgd`
cannot travel as equal pieces (a data-dependent count; factors of whole matrices): their
aggregator (`AGGREGATED`, data parallelism's own, with Adam behind it) forms the whole
approximate sum on every replica, which keeps its piece (`_aggregate`), so ZeRO-2 there
holds the whole gradient sum as ZeRO-1 does. The weights' all-gather stays fp32.

With Adam, lowbit, top-k and PowerSGD (`ADAM_FRONT`) take Adam in front of the codec by
default (`adam_in_front`), as data parallelism does: Adam behind them ended outside fp32's
band on the quality suite's transformer (docs/guides/memory.md). That step is data
parallelism's own (`_tfpar_front_step`: the codec's aggregator with
`tfpar.compression.adam_front`), and so is its memory: 1-bit Adam compresses each
replica's own Adam step, so each replica holds its own whole-size moments (and `v` moves
with each replica's own gradient by default), which no piece of ZeRO's can hold; the
summed steps reach every replica, which updates every weight (no gather).
`--nocompress_adam_step` (or `--offload=optimizer`) keeps Adam behind the codec, sharded,
with one warning line (`adam_behind_line`).

A codec's state is checkpointed under data parallelism's names (`tfpar.state`,
`codec/<weight path>/<kind>`), read in the step as the slots are: `zero_residual` cut per
weight (`residual_entries`), each row a replica's share of what the sum owes as a
tf.distribute aggregator's; the aggregator's own state as on data parallelism
(`aggregator_of`). So a checkpoint of ZeRO 1/2 with a codec resumes on data parallelism
with that codec, on another replica count, and the reverse.

With `--mixed_precision=fp16` Keras's `LossScaleOptimizer` (`tfpar.nan_guard.
ConsistentLossScaleOptimizer`) wraps this optimizer and unscales each replica's gradients
in fp32 before this update, so the reduce-scatter carries unscaled gradients. Before, not
after: the overflow decision is taken on the local gradients (all-reduced as one flag) so
an overflowing step is skipped by every replica before any piece is sent, and no shard,
slot or residual moves; the residual of error feedback stays in the gradient's units, valid
whatever the scale becomes (a scaled residual would be off by the factor the scale changed
by). The codec's range is not at stake: int8's blocks carry their own scale, bf16 has
fp32's exponent, and fp16 on the wire drops entries below 6e-8, which error feedback
keeps. Helpers that read a ZeRO optimizer look through the wrapper (`zero_of`).

Checkpoints save the slots whole: `ShardedSlot` gathers every replica's piece (from every
worker) into one `[N, S]` tensor; a restore onto the same replica count gives each its row
back, onto another count it re-cuts the flat vector.

Stage 3 (parameters sharded too) is not on tf.distribute: its weights stay mirrored
here; `--zero_stage=3` runs on a DTensor mesh (`tfpar.zero.fsdp`, beside this module).
"""

import itertools

import keras
from absl import logging
import numpy as np
import tensorflow as tf

from tfpar import nan_guard, patches
from tfpar.compression import aggregator as aggregator_lib
from tfpar.compression import codecs, collectives
from tfpar.compression.collectives import nbytes as collectives_nbytes
from tfpar.config import ADAM_FRONT_CODECS, LOWBIT_BITS, TOPK_DENSE_BELOW, TOPK_RATIO
from tfpar.errors import ConfigError
from tfpar.zero import piece_codecs

# One collective group of all replicas, with keys far from those tf.distribute hands out
# (they count up from 1).
_GROUP_KEY = 0x2E40
_INSTANCE_REDUCE_SCATTER, _INSTANCE_GATHER, _INSTANCE_RANKS = 0x2E400, 0x2E401, 0x2E402
# Each ZeRO optimizer built in a process gets its own instance keys (one collective
# instance has one shape: two models' gathers under one key fail with a shape mismatch).
# Workers build their optimizers in the same order, so the keys agree across workers.
_INSTANCES = itertools.count(0x2E410, 4)


class ZeroMixin:
    """Mixin for a Keras 3 `SGD` or `Adam` (TensorFlow backend): ZeRO stage 1 or 2 update.

    Expects `self.tfpar_zero_stage`, `self.tfpar_zero_timeout_s`, `self.tfpar_zero_codec`
    and `self.tfpar_zero_error_feedback`; `self.tfpar_skip_nonfinite`
    (set by `tfpar.nan_guard.skip_nonfinite_updates`) makes a step with non-finite
    gradients leave weights and slots untouched.
    """

    def build(self, variables):
        # The base build only (iterations, variable indices): no full-size slots.
        patches.base_build(self, variables)
        nan_guard.add_counter(self)
        strategy = tf.distribute.get_strategy()
        self._tfpar_layout = FlatLayout(variables, strategy.num_replicas_in_sync)
        self._tfpar_layout.instance = next(_INSTANCES)
        with tf.init_scope():
            self._tfpar_layout.tokens = ordering_tokens(strategy)
            slots = {name: aggregator_lib.per_replica_variable(
                tf.zeros([self._tfpar_layout.piece]), f"zero_{name}",
                tf.VariableAggregation.ONLY_FIRST_REPLICA)
                for name in self._tfpar_slot_names()}
        # Held by a plain object, so neither Keras nor TensorFlow tracks the variables
        # (a checkpoint of an ON_READ variable keeps one replica's piece): each is saved
        # through a ShardedSlot, which keeps every replica's.
        self._tfpar_layout.slots = slots
        for name, variable in slots.items():
            setattr(self, f"tfpar_zero_{name}", ShardedSlot(variable, self._tfpar_layout.size))
        self._tfpar_layout.residual = None
        aggregator = self.tfpar_zero_aggregator
        self._tfpar_layout.aggregator = aggregator
        self._tfpar_layout.front = getattr(aggregator, "adam", None) is not None
        self._tfpar_layout.piece_codec = None if self._tfpar_layout.front else piece_codecs.make(
            self.tfpar_zero_codec, self._tfpar_layout.sizes, self._tfpar_layout.replicas,
            self._tfpar_layout.piece, self.tfpar_zero_codec_options)
        if aggregator is not None:
            # Its residuals (and PowerSGD's Q, its step) are per replica in its own
            # variables: checkpointed as data parallelism's (`tfpar.state`, `codec/...`).
            aggregator.build([v.value if isinstance(v, keras.Variable) else v
                              for v in variables])
        elif self.tfpar_zero_codec != "none" and self.tfpar_zero_error_feedback:
            # Error feedback of the compressed reduce-scatter: what this replica's message
            # dropped, over the whole unpadded flat gradient (its length does not depend on
            # the replica count), checkpointed per weight (`residual_entries`).
            with tf.init_scope():
                residual = aggregator_lib.per_replica_variable(
                    tf.zeros([self._tfpar_layout.size]), "zero_residual",
                    tf.VariableAggregation.MEAN)
            self._tfpar_layout.residual = residual
        if strategy.num_replicas_in_sync > 1 and tf.executing_eagerly():
            check_ranks(strategy, self._tfpar_layout.tokens, self.tfpar_zero_timeout_s,
                        self._tfpar_layout.instance + 2)

    # Keras's private step, overridden: registry entry `optimizer_hooks` of tfpar.patches.
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            raise RuntimeError("a ZeRO optimizer updates in replica context (model.fit or "
                               "strategy.run)")
        layout = self._tfpar_layout
        variables = [v.value if isinstance(v, keras.Variable) else v
                     for v in trainable_variables]
        n = layout.replicas
        if layout.front and n > 1:
            return self._tfpar_front_step(ctx, grads, variables, learning_rate)
        flat_grads = layout.flatten(grads, variables)
        # Adam's second moment of a sparse gradient, as Keras computes it (see `_adam`):
        # the sum over replicas of each replica's sum of squared slices.
        sparse = [(g, v) for g, v in zip(grads, variables)
                  if isinstance(g, tf.IndexedSlices)] if isinstance(
                      self, keras.optimizers.Adam) else []
        squares = layout.flatten([_slice_squares(g) for g, _ in sparse],
                                 [v for _, v in sparse]) if sparse else None
        grad_piece, square_piece, new_residual, local_bad, agreed = self._tfpar_reduce(
            ctx, grads, variables, flat_grads, squares)
        if sparse:
            mask = layout.flatten([tf.ones(v.shape) for _, v in sparse],
                                  [v for _, v in sparse])
            mask = _own(mask, ctx, n) if n > 1 else mask
            square_piece = tf.where(mask > 0, square_piece, tf.square(grad_piece))
        if agreed is not None:  # every replica holds the whole sum: already decided
            bad = agreed
        else:  # every replica learns whether any piece is non-finite (one scalar all-reduce)
            bad = 1.0 - tf.cast(tf.reduce_all(tf.math.is_finite(grad_piece)), tf.float32)
            if local_bad is not None:
                bad = tf.maximum(bad, local_bad)
            if n > 1:
                bad = tf.minimum(ctx.all_reduce(tf.distribute.ReduceOp.SUM, bad), 1.0)
        finite = tf.equal(bad, 0.0)
        params = layout.flatten([tf.convert_to_tensor(v) for v in variables], variables)
        param_piece = _own(params, ctx, n) if n > 1 else params
        slots = {k: tf.convert_to_tensor(v) for k, v in layout.slots.items()}
        new_piece, new_slots = self._tfpar_update(param_piece, grad_piece, slots,
                                                  learning_rate, square_piece, finite)
        if getattr(self, "tfpar_skip_nonfinite", False):
            new_piece = tf.where(finite, new_piece, param_piece)
            new_slots = {k: tf.where(finite, v, slots[k]) for k, v in new_slots.items()}
        for name, value in new_slots.items():
            layout.slots[name].assign(value)
        residual = layout.residual
        if residual is not None and new_residual is not None:
            # A step with a non-finite gradient leaves the residual as it was.
            residual.assign(tf.where(finite, new_residual, tf.convert_to_tensor(residual)))
        full = (all_gather(new_piece, n, layout.tokens, self.tfpar_zero_timeout_s,
                           layout.instance + 1)
                if n > 1 else new_piece)
        for variable, value in zip(variables, layout.unflatten(full, variables)):
            variable.assign(tf.cast(value, variable.dtype))
        self.nonfinite_steps.assign_add(bad)

    def _tfpar_front_step(self, ctx, grads, variables, learning_rate):
        """Adam in front of the codec: data parallelism's step, `tfpar.compression.
        adam_front` through the codec's aggregator (exact warm-up, then each replica's
        compressed Adam step). It hands every replica the same summed steps, which each
        applies to its mirrored copy of every weight as data parallelism's optimizer does
        (`w − lr · step`): nothing is left to gather. Each replica's moments are its own,
        whole-size (1-bit Adam's momentum is each replica's; `v` too with its default
        `local_debiased`), in the aggregator under data parallelism's names, so ZeRO's
        sharded slots stay unused here (kept, zero, so a checkpoint has the slots data
        parallelism's Keras Adam has)."""
        aggregator = self._tfpar_layout.aggregator
        skip = getattr(self, "tfpar_skip_nonfinite", False)
        if skip:
            # `--on_nan=skip_step`: the aggregator runs only when every replica's gradients
            # are finite (one scalar all-reduce), so its moments and residuals stay as they
            # were on a skipped step (data parallelism's `_skip_nonfinite_sum`).
            present = [tf.convert_to_tensor(g) for g in grads if g is not None]
            local_bad = 1.0 - tf.cast(tf.math.is_finite(tf.add_n(
                [tf.reduce_sum(tf.cast(g, tf.float32)) for g in present])), tf.float32)
            steps, any_bad = _aggregate(aggregator, ctx, grads, variables, local_bad)
        else:
            # `--on_nan=stop` (the run ends at a non-finite step; fp16's overflow never
            # reaches here): as data parallelism, no all-reduce before the aggregator.
            steps, any_bad = aggregator.all_reduce_sum(list(grads), variables), 0.0
        # The same bytes on every replica: whether a step is non-finite needs no all-reduce.
        # One pass per tensor, as `tfpar.nan_guard` (a sum is finite iff every entry is).
        bad = tf.maximum(any_bad, 1.0 - tf.cast(tf.math.is_finite(tf.add_n(
            [tf.reduce_sum(s) for s in steps if s is not None])), tf.float32))
        finite = tf.equal(bad, 0.0)
        for variable, step in zip(variables, steps):
            if step is None:
                continue
            lr = tf.cast(learning_rate, variable.dtype)
            new = variable - lr * tf.cast(step, variable.dtype)
            variable.assign(tf.where(finite, new, variable) if skip else new)
        self._tfpar_layout.wire_bytes = 0  # the aggregator's own count (`wire_bytes`)
        self.nonfinite_steps.assign_add(bad)

    def _tfpar_reduce(self, ctx, grads, variables, flat_grads, squares):
        """This replica's piece of the summed gradient (and of the summed squared slices,
        `squares`, if any): `(grad_piece, square_piece, new_residual or None, local_bad or
        None, agreed or None)`, `local_bad` 1.0 where this replica's own gradient is
        non-finite; `agreed`, with an aggregator, 1.0 on every replica where any replica's
        gradient or the whole sum is non-finite (no further all-reduce needed)."""
        layout, n, codec = self._tfpar_layout, self._tfpar_layout.replicas, self.tfpar_zero_codec
        timeout, instance = self.tfpar_zero_timeout_s, layout.instance
        residual = layout.residual
        local_bad = None
        if codec != "none":
            # A non-finite gradient is caught before the codec sees it (int8's scale of a
            # NaN is not something to rely on).
            local_bad = 1.0 - tf.cast(tf.reduce_all(tf.math.is_finite(flat_grads)), tf.float32)
        if residual is not None:
            flat_grads = flat_grads + tf.pad(tf.convert_to_tensor(residual),
                                             [[0, layout.padded - layout.size]])
        if n == 1:
            # Sent whole: a residual loaded from more replicas is spent at once.
            layout.wire_bytes = 0
            spent = tf.zeros([layout.size]) if residual is not None else None
            if layout.aggregator is not None:
                flat_grads = _with_loaded_debt(layout, variables, flat_grads)
            return flat_grads, squares, spent, local_bad, None
        square_piece, new_residual, wire, agreed = None, None, 0, None
        if layout.aggregator is not None:
            # The aggregator's all-reduce forms the whole (approximate) sum on every
            # replica; each keeps its piece.
            summed, any_bad = _aggregate(layout.aggregator, ctx, grads, variables, local_bad)
            whole = layout.flatten(summed, variables)
            grad_piece = _own(whole, ctx, n)
            # The sum is the same bytes on every replica (the ring hands every rank the
            # same result, the same local ops follow): its finiteness needs no all-reduce.
            # One pass, as `tfpar.nan_guard`: a sum is finite iff every entry is (a sum of
            # finite entries past float32's range aside, which skips the step too).
            agreed = tf.maximum(any_bad, 1.0 - tf.cast(
                tf.math.is_finite(tf.reduce_sum(whole)), tf.float32))
        elif codec != "none":
            # Stages 1 and 2 alike: a compressed reduce-scatter (each replica needs only the
            # sum of its own piece), the pieces travelling in the codec.
            piece_codec = layout.piece_codec or codec
            sent = encode_pieces(flat_grads, n, piece_codec, self.iterations)
            grad_piece = reduce_scatter_encoded(sent, n, piece_codec, layout.piece,
                                                layout.tokens, timeout, instance)
            if residual is not None:
                new_residual = (flat_grads - tf.reshape(
                    decode_own(sent, piece_codec, layout.piece), [-1]))[:layout.size]
            wire = collectives_nbytes(sent)
        elif self.tfpar_zero_stage >= 2:
            grad_piece = reduce_scatter(flat_grads, n, layout.tokens, timeout, instance)
            square_piece = (reduce_scatter(squares, n, layout.tokens, timeout, instance + 3)
                            if squares is not None else None)
            layout.wire_bytes = 4 * ((1 if squares is None else 2) * layout.padded
                                     + layout.piece)
            return grad_piece, square_piece, None, local_bad, None
        else:
            # One all-reduce of both vectors.
            both = flat_grads if squares is None else tf.concat([flat_grads, squares], 0)
            both = tf.reshape(ctx.all_reduce(tf.distribute.ReduceOp.SUM, both), [-1])
            layout.wire_bytes = 4 * ((1 if squares is None else 2) * layout.padded
                                     + layout.piece)
            return (_own(both[:layout.padded], ctx, n),
                    None if squares is None else _own(both[layout.padded:], ctx, n),
                    None, local_bad, None)
        if squares is not None:
            # Adam's summed squared slices divide the step: int8 and fp16 would round
            # a small one to 0 (a step of m / epsilon); bf16 keeps fp32's range.
            sent_squares = encode_pieces(squares, n, "bf16")
            square_piece = reduce_scatter_encoded(sent_squares, n, "bf16", layout.piece,
                                                  layout.tokens, timeout, instance + 3)
            wire += collectives_nbytes(sent_squares)
        layout.wire_bytes = wire + 4 * layout.piece
        return grad_piece, square_piece, new_residual, local_bad, agreed

    def _tfpar_slot_names(self):
        # The slots held on the devices (`tfpar.offload` keeps them on the host instead).
        return slot_names(self)

    def _tfpar_update(self, param, grad, slots, learning_rate, square=None, finite=None):
        del finite  # the caller keeps the old values where it is False
        lr = tf.cast(learning_rate, tf.float32)
        if isinstance(self, keras.optimizers.Adam):
            return _adam(self, param, grad, slots, lr, square)
        return _sgd(self, param, grad, slots, lr)


def _slice_squares(grad):
    """An `IndexedSlices` gradient's squared slices summed per row, dense."""
    rows = tf.cast(grad.dense_shape[0], grad.indices.dtype)
    return tf.math.unsorted_segment_sum(tf.square(tf.cast(grad.values, tf.float32)),
                                        grad.indices, rows)


def slot_names(optimizer):
    """The sharded slots `optimizer` needs."""
    if isinstance(optimizer, keras.optimizers.Adam):
        return ("momentum", "velocity")
    return ("momentum",) if optimizer.momentum else ()


def _sgd(opt, param, grad, slots, lr):
    # keras.optimizers.SGD.update_step (keras 3.15.1), on one flat piece.
    if not opt.momentum:
        return param - grad * lr, {}
    momentum = tf.cast(opt.momentum, param.dtype)
    m = slots["momentum"] * momentum - grad * lr
    step = m * momentum - grad * lr if opt.nesterov else m
    return param + step, {"momentum": m}


def _adam(opt, param, grad, slots, lr, square=None):
    # keras.optimizers.Adam.update_step (keras 3.15.1, amsgrad=False), on one flat piece.
    # `square` is the gradient's square where Keras squares something else: for an
    # `IndexedSlices` gradient (an embedding's), Keras's `ops.square` squares each slice
    # and the sum adds them up, so v gets the sum of the squared slices (one per token
    # occurrence per replica), not the square of the summed gradient; `square` carries
    # that sum there (`_slice_squares`, summed over replicas) and `grad ** 2` elsewhere.
    local_step = tf.cast(opt.iterations + 1, param.dtype)
    beta_1_power = tf.pow(tf.cast(opt.beta_1, param.dtype), local_step)
    beta_2_power = tf.pow(tf.cast(opt.beta_2, param.dtype), local_step)
    alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    m, v = slots["momentum"], slots["velocity"]
    m = m + (grad - m) * (1 - opt.beta_1)
    v = v + ((tf.square(grad) if square is None else square) - v) * (1 - opt.beta_2)
    return param - (m * alpha) / (tf.sqrt(v) + opt.epsilon), {"momentum": m, "velocity": v}


def zero_of(optimizer):
    """The ZeRO 1/2 optimizer `optimizer` is or wraps (fp16's `LossScaleOptimizer` holds it
    as `inner_optimizer`), or None."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return zero_of(inner)
    return optimizer if getattr(optimizer, "_tfpar_layout", None) is not None else None


def state_variables(optimizer):
    """The sharded slot variables of a ZeRO `optimizer`, or of the one it wraps (empty for
    any other); with Adam in front of its codec (`adam_in_front`) also the aggregator's
    whole-size moments and residuals, every replica's copy (the sharded slots stay
    allocated beside them)."""
    zero = zero_of(optimizer)
    if zero is None:
        return []
    out = list(zero._tfpar_layout.slots.values())
    aggregator = zero._tfpar_layout.aggregator
    if aggregator is not None and getattr(aggregator, "adam", None) is not None:
        out += list(getattr(aggregator, "moments", {}).values())
        out += list(getattr(aggregator, "residuals", {}).values())
    return out


def slot_entries(optimizer, weights):
    """`[(weight, slot name, (read, write, shape))]` of a ZeRO 1/2 `optimizer`'s sharded
    slots cut back into `weights`' shapes (empty for any other optimizer): `read()` gives
    the weight's whole slot as numpy (the pieces gathered once per call of this function),
    `write(array)` takes it; the flat slot is written once every weight's part has come
    (`tfpar.state` names them as a single optimizer's)."""
    layout = getattr(optimizer, "_tfpar_layout", None)
    if layout is None:
        return []
    by_index = {layout.keys[_key(w)]: w for w in weights if _key(w) in layout.keys}
    return [(by_index[i], slot, entry) for slot, variable in layout.slots.items()
            for i, entry in enumerate(_slot_parts(layout, variable))]


def aggregator_of(optimizer):
    """The aggregator whose whole sum a ZeRO 1/2 `optimizer` (or the one it wraps) keeps
    its piece of (`AGGREGATED` codecs), or None."""
    zero = zero_of(optimizer)
    return zero._tfpar_layout.aggregator if zero is not None else None


def residual_entries(optimizer, weights):
    """`[(weight, (read, write, shape))]` of the error feedback of a ZeRO 1/2 `optimizer`'s
    compressed reduce-scatter (empty without one), cut into `weights`' shapes, one row per
    replica: `read()` gives `[replicas, *shape]` (every replica's flat residual gathered
    once per call of this function, in the caller's thread); `write(rows)` puts rows of
    any count into this weight's part, onto another replica count replica 0 taking their
    sum and the others zero (`aggregator.restore_replicas`'s rule).

    A row is what that replica's message left out of its gradient, which the reduce-scatter
    sums over replicas: its share of the sum, as a tf.distribute aggregator's residual
    (`tfpar.state`'s "share" units), so data parallelism with the same codec loads it."""
    layout = getattr(zero_of(optimizer), "_tfpar_layout", None)
    if layout is None or layout.residual is None:
        return []
    offsets = np.cumsum([0] + layout.sizes)
    gathered = []

    def rows():
        if not gathered:
            gathered.append(aggregator_lib.stack_replicas(layout.residual).numpy())
        return gathered[0]

    def part(i):
        shape = tuple(layout.shapes[i])

        def read():
            return rows()[:, offsets[i]:offsets[i + 1]].reshape((-1,) + shape)

        def write(array):
            array = np.reshape(np.asarray(array, np.float32), [len(array), -1])
            if len(array) != layout.replicas:
                moved = np.zeros([layout.replicas, array.shape[1]], np.float32)
                moved[0] = array.sum(0)
                array = moved
            # Read back whole each time: a checkpoint may hold some weights' parts only
            # (PowerSGD's vectors on data parallelism are sent exactly, with no residual).
            whole = aggregator_lib.stack_replicas(layout.residual).numpy()
            whole[:, offsets[i]:offsets[i + 1]] = array
            aggregator_lib.restore_replicas(layout.residual, tf.constant(whole))
            gathered.clear()
        return read, write, (None,) + shape
    by_index = {layout.keys[_key(w)]: w for w in weights if _key(w) in layout.keys}
    return [(by_index[i], part(i)) for i in range(len(layout.sizes)) if i in by_index]


def _with_loaded_debt(layout, variables, flat_grads):
    """On one replica, `flat_grads` with the debt of error feedback that `layout`'s
    aggregator (PowerSGD, threshold) loaded from more replicas added while its
    `debt_owed` flag is set (`tfpar.state`), as `keras_hook.pay_debt` pays it: where the
    step is applied (every entry finite, this step's test) its residuals then turn zero and
    the flag clears; a skipped step keeps both for the next."""
    aggregator = layout.aggregator
    flag = getattr(aggregator, "debt_owed", None)
    owed = []
    for v in variables:
        position = aggregator.position_of(v)
        owed.append(aggregator.residuals.get(str(position)) if position is not None else None)
    if flag is None or not any(r is not None for r in owed):
        return flat_grads

    def pay():
        debts = [None if r is None else tf.convert_to_tensor(r) for r in owed]
        paid = flat_grads + layout.flatten(debts, variables)
        applied = tf.reduce_all(tf.math.is_finite(paid))
        writes = [r.assign(tf.where(applied, tf.zeros_like(d), d))
                  for r, d in zip(owed, debts) if r is not None]
        writes.append(flag.assign(tf.logical_not(applied)))
        with tf.control_dependencies(writes):
            return tf.identity(paid)
    return tf.cond(tf.convert_to_tensor(flag), pay, lambda: flat_grads)


def _slot_parts(layout, variable):
    """Per weight, (read, write, shape) of its part of one flat slot (`[N, S]` pieces)."""
    gathered = []

    def flat():
        if not gathered:
            gathered.append(np.reshape(aggregator_lib._stack_replicas(variable).numpy(), [-1]))
        return gathered[0]

    def write_whole(whole):
        aggregator_lib._restore_replicas(
            variable, tf.constant(whole.reshape([layout.replicas, layout.piece])))
    return flat_parts(layout, flat, write_whole)


def flat_parts(layout, flat, write_whole):
    """Per weight of `layout` (a `FlatLayout`), `(read, write, shape)` of its part of one
    flat slot: `read()` cuts it from `flat()` (the whole padded slot as numpy); `write`
    keeps each part until every weight's has come, then hands the padded whole to
    `write_whole` (ZeRO's pieces on the devices, or offload's on the host)."""
    offsets = np.cumsum([0] + layout.sizes)
    cache = {}

    def part(i):
        def read():
            return flat()[offsets[i]:offsets[i + 1]].reshape(layout.shapes[i])

        def write(array):
            cache[i] = np.reshape(np.asarray(array, np.float32), [-1])
            if len(cache) == len(layout.sizes):
                whole = np.zeros([layout.padded], np.float32)
                for j, values in cache.items():
                    whole[offsets[j]:offsets[j + 1]] = values
                write_whole(whole)
                cache.clear()
        return read, write, tuple(layout.shapes[i])
    return [part(i) for i in range(len(layout.sizes))]


class FlatLayout:
    """Where each variable sits in the flat, padded vector (`size` elements, `replicas`
    pieces of `piece`), and the sharded slots (`slots`, set by the optimizer's build)."""

    def __init__(self, variables, replicas):
        self.slots = {}
        self.aggregator = None  # set by the optimizer's build (`AGGREGATED` codecs)
        self.front = False  # the aggregator takes Adam in front (`adam_in_front`)
        self._wire = 0
        self.replicas = replicas
        self.keys = {_key(v): i for i, v in enumerate(variables)}
        self.shapes = [tuple(int(d) for d in v.shape) for v in variables]
        self.sizes = [int(tf.TensorShape(s).num_elements()) for s in self.shapes]
        self.size = sum(self.sizes)
        self.piece = -(-self.size // replicas)
        self.padded = self.piece * replicas

    @property
    def wire_bytes(self):
        """Bytes one replica handed to the collectives on the last step traced (with an
        aggregator: its measured count on the last step run, plus the rest)."""
        if self.aggregator is None or not self.aggregator.built:
            return self._wire
        return self._wire + int(self.aggregator.wire_bytes.numpy())

    @wire_bytes.setter
    def wire_bytes(self, value):
        self._wire = value

    def flatten(self, tensors, variables):
        """`tensors` (one per `variables`, None = zeros) as one padded fp32 vector."""
        parts = [tf.zeros([s]) for s in self.sizes]
        for t, v in zip(tensors, variables):
            if t is not None:
                parts[self.keys[_key(v)]] = tf.reshape(
                    tf.cast(tf.convert_to_tensor(t), tf.float32), [-1])
        parts.append(tf.zeros([self.piece * self.replicas - self.size]))
        return tf.concat(parts, 0)

    def unflatten(self, flat, variables):
        """The values of `variables` from the flat vector."""
        offsets, start = [], 0
        for s in self.sizes:
            offsets.append(start)
            start += s
        out = []
        for v in variables:
            i = self.keys[_key(v)]
            out.append(tf.reshape(flat[offsets[i]:offsets[i] + self.sizes[i]], self.shapes[i]))
        return out


def _key(variable):
    if not isinstance(variable, tf.Variable) and hasattr(variable, "value"):
        variable = variable.value
    return variable.ref()


def _own(flat, ctx, n):
    """This replica's piece of a full flat vector."""
    return tf.gather(tf.reshape(flat, [n, -1]), ctx.replica_id_in_sync_group)


def ordering_tokens(strategy):
    """One resource per local replica's device, for the collectives to take as ordering
    token.

    A collective op without a resource input is stateful and unordered, so a
    `tf.function` chains all of them in program order, across replicas too: replica 1's
    gather would wait for replica 0's, which waits for replica 1's (a deadlock).
    Taking its device's token, each is ordered only after the ops of its own device
    (what `tf.distribute`'s own collective launcher does).
    """
    tokens = []
    for device in strategy.extended.worker_devices:  # in local replica order
        with tf.device(device):
            # Not through the strategy's variable creator: one plain variable per device.
            tokens.append(patches.plain_variable(0.))
    return tokens


def _token(tokens):
    # The local replica's index, as tf.distribute's own variables pick their component
    # (the current device is not known while a tf.function is traced).
    return [tokens[patches.replica_index()].handle]


def reduce_scatter(flat, n, tokens, timeout_s, instance_key=_INSTANCE_REDUCE_SCATTER):
    """Sum over replicas of `flat`, of which this replica receives piece `rank`.

    An all-to-all (`CollectiveAllToAllV2`: replica `r` receives piece `r` of every
    replica's vector, `n` pieces of `S`) and a local sum of those pieces: the traffic of a
    reduce-scatter (each replica receives `(n - 1) * S` elements from the others), where
    TensorFlow 2.21's own `CollectiveReduceScatterV2` has no CPU implementation
    ("CollectiveRegistry::Lookup did not find collective implementation").
    """
    pieces = tf.raw_ops.CollectiveAllToAllV2(
        input=tf.reshape(flat, [n, -1]), group_size=n, group_key=_GROUP_KEY,
        instance_key=instance_key, ordering_token=_token(tokens),
        timeout_seconds=timeout_s or 0)
    return tf.add_n(tf.unstack(pieces, n))


# The codecs of the compressed reduce-scatter (`--compression` with `--zero_stage=1|2`):
# cast or int8 here, lowbit and top-k per piece (`tfpar.zero.piece_codecs`).
CODECS = ("fp16", "bf16", "int8", "lowbit", "topk")
# The codecs whose message length is data dependent (threshold) or which are linear in
# the whole matrix (PowerSGD, auto's ranks): their aggregator's all-reduce forms the whole
# sum on every replica, which keeps its piece (`_aggregate`).
AGGREGATED = ("threshold", "powersgd", "auto")
_CAST = {"fp16": tf.float16, "bf16": tf.bfloat16}
INT8_BLOCK = 256  # entries per fp32 scale, as `tfpar.compression.Int8Aggregator`'s


# Codecs that take Adam in front of them with Adam (`adam_in_front`), as on data
# parallelism (`tfpar.compression.ADAM_STEP_AGGREGATORS`): behind them, on the quality
# suite's transformer task, ZeRO-2 ended outside fp32's band (docs/guides/memory.md).
ADAM_FRONT = ADAM_FRONT_CODECS


def adam_in_front(config):
    """Whether ZeRO 1/2 runs `config`'s codec with Adam in front of it (data parallelism's
    `tfpar.compression.adam_front` step: the default for Adam with an `ADAM_FRONT` codec;
    `--nocompress_adam_step` or `--offload=optimizer` keep Keras's Adam behind it)."""
    return (config.zero_stage in (1, 2) and config.optimizer == "adam"
            and config.compress_adam_step and config.compression in ADAM_FRONT
            and config.offload == "none")


# Top-k on ZeRO 1/2 sends each piece to its owner alone, which sums what arrives: the union
# of the replicas' indices would need every replica's indices all-gathered (the traffic a
# reduce-scatter avoids), so `--topk_union` (data parallelism's default) does nothing here.
TOPK_UNION_LINE = ("--topk_union has no effect with --zero_stage=1|2: ZeRO's top-k sends each "
                   "piece to its owner, which sums what arrives (no union of the replicas' "
                   "indices); --notopk_union says so, --zero_stage=0 has the union")


def adam_behind_line(codec):
    """The one line ZeRO 1/2 logs for `codec` (one of `ADAM_FRONT`) with Adam behind it."""
    return (f"--zero_stage=1|2 --compression={codec} with Adam behind the codec "
            "(--nocompress_adam_step or --offload=optimizer): the codec compresses the raw "
            "gradient and Keras's Adam updates the sharded moments from the sum; on the "
            "quality suite's transformer task that ended 13.6-18.0 % above fp32, outside its "
            "band (docs/guides/memory.md). The default (--compress_adam_step, no offload) "
            "puts Adam in front of the codec, as data parallelism does; int8 keeps Adam's "
            "moments sharded within the band")


def adam_front_line(codec):
    """The one line ZeRO 1/2 logs for `codec` (one of `ADAM_FRONT`) with Adam in front."""
    return (f"--zero_stage=1|2 --compression={codec} with Adam: Adam in front of the codec, "
            "data parallelism's step, which saves no memory over data parallelism: each "
            "replica holds Adam's moments whole-size (1-bit Adam's momentum is each "
            "replica's own) beside ZeRO's 1/N slots, and whole gradients (no ZeRO-2 "
            "sharding); --nocompress_adam_step shards them with Adam behind the codec, "
            "13.6-18.0 % above fp32 on the quality suite's transformer, outside its band "
            "(docs/guides/memory.md)")


def encode_pieces(flat, n, codec, step=None):
    """The `n` pieces of the padded flat vector as they go on the wire in `codec`.

    fp16/bf16: each piece cast, `[n, S]`. int8: each piece quantised in blocks of
    `INT8_BLOCK` entries with one fp32 scale each (qgZ's blockwise quantisation), the codes
    packed 4 to an int32 word and the scales' bits appended, `[n, ceil(S/4) + blocks]`
    int32: every piece carries its own scales, so its receiver decodes it alone. A piece
    codec of `tfpar.zero.piece_codecs` (lowbit, top-k): its own `encode` (`step` seeds
    top-k's sampled threshold).
    """
    rows = tf.reshape(flat, [n, -1])
    if not isinstance(codec, str):
        return codec.encode(rows, step)
    if codec in _CAST:
        return tf.cast(rows, _CAST[codec])
    encoded = []
    for row in tf.unstack(rows, n):
        codes, scales = codecs.quantize_int8_blocks(row, INT8_BLOCK)
        encoded.append(tf.concat([codecs.pack_int8(codes), tf.bitcast(scales, tf.int32)], 0))
    return tf.stack(encoded)


def decode_pieces(encoded, codec, piece, rank=None):
    """Inverse of `encode_pieces`: `[n, S]` float32 from `[n, ...]` encoded pieces (of the
    piece of `rank`, for a piece codec whose layout depends on it)."""
    if not isinstance(codec, str):
        return codec.decode(encoded, rank)
    if codec in _CAST:
        return tf.cast(encoded, tf.float32)
    blocks = codecs.int8_blocks(piece, INT8_BLOCK)
    scales = tf.bitcast(encoded[:, -blocks:], tf.float32)
    return codecs.dequantize_int8_blocks(codecs.unpack_int8(encoded[:, :-blocks], piece),
                                         scales, INT8_BLOCK, piece)


def decode_own(sent, codec, piece):
    """What this replica's own `n` messages (`encode_pieces`) decode to, `[n, S]`."""
    return decode_pieces(sent, codec, piece) if isinstance(codec, str) else codec.decode_own(sent)


def reduce_scatter_encoded(encoded, n, codec, piece, tokens, timeout_s, instance_key):
    """`reduce_scatter` of pieces encoded by `encode_pieces`: replica `r` receives piece `r`
    of every replica's message (an all-to-all in the codec's dtype), decodes them and sums
    in fp32, in rank order (every owner sums the same way)."""
    received = tf.raw_ops.CollectiveAllToAllV2(
        input=encoded, group_size=n, group_key=_GROUP_KEY, instance_key=instance_key,
        ordering_token=_token(tokens), timeout_seconds=timeout_s or 0)
    rank = tf.distribute.get_replica_context().replica_id_in_sync_group  # = rank: check_ranks
    return tf.add_n(tf.unstack(decode_pieces(received, codec, piece, rank), n))


def _aggregate(aggregator, ctx, grads, variables, local_bad):
    """`(sum, any_bad)`: the sum of `grads` over replicas through `aggregator`, on every
    replica; run only when every replica's gradients are finite (one scalar all-reduce
    decides: `any_bad`, 1.0 if not), so a non-finite step leaves its residuals and
    PowerSGD's Q as they were, and hands back NaN (the update then skips it)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    dense = tuple(tf.convert_to_tensor(grads[i]) for i in present)
    subset = [variables[i] for i in present]
    bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM, local_bad)

    def run(*gs):
        return aggregator.all_reduce_sum(list(gs), subset)

    def skip(*gs):
        return [tf.fill(tf.shape(g), tf.constant(float("nan"), g.dtype)) for g in gs]

    out = collectives.replica_cond(tf.equal(bad, 0.0), run, skip, dense)
    summed = [None] * len(grads)
    for i, s in zip(present, out):
        summed[i] = s
    return summed, tf.minimum(bad, 1.0)


def all_gather(piece, n, tokens, timeout_s, instance_key=_INSTANCE_GATHER):
    """Every replica's `piece`, concatenated in rank order."""
    return tf.raw_ops.CollectiveGatherV2(
        input=piece, group_size=n, group_key=_GROUP_KEY, instance_key=instance_key,
        ordering_token=_token(tokens), timeout_seconds=timeout_s or 0)


def check_ranks(strategy, tokens, timeout_s, instance_key=_INSTANCE_RANKS):
    """Checks once that each replica's rank in the collective group is its replica id (the
    order in which pieces are owned and checkpointed).

    Raises:
        RuntimeError: they differ (a device order tfpar does not expect).
    """
    n = strategy.num_replicas_in_sync

    @tf.function
    def gather_ids():
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            return all_gather(tf.reshape(tf.cast(rid, tf.int32), [1]), n, tokens, timeout_s,
                              instance_key)
        return strategy.run(fn)

    ids = strategy.experimental_local_results(gather_ids())[0].numpy().tolist()
    if ids != list(range(n)):
        raise RuntimeError(f"ZeRO: collective ranks {ids} do not follow replica ids; "
                           "run without --zero_stage")


class ShardedSlot(patches.Trackable):
    """Checkpoints every replica's piece of a sharded slot as one `[N, S]` tensor.

    Args:
        variable: the `ON_READ` variable holding each replica's piece.
        size: elements of the unpadded flat vector (`FlatLayout.size`).
    """

    def __init__(self, variable, size):
        self._variable, self._size = variable, size

    # TensorFlow's checkpoint protocol: registry entry `trackable_tensors` of tfpar.patches.
    def _serialize_to_tensors(self):
        return {"pieces": aggregator_lib._stack_replicas(self._variable)}

    def _restore_from_tensors(self, restored_tensors):
        stacked = restored_tensors["pieces"]
        strategy, local = aggregator_lib._local_components(self._variable)
        replicas = strategy.num_replicas_in_sync if strategy is not None else 1
        piece = int(local[0].shape[0])
        if int(stacked.shape[0]) != replicas:
            # Saved by another replica count: re-cut the flat vector.
            flat = tf.reshape(stacked, [-1])[:self._size]
            flat = tf.concat([flat, tf.zeros([replicas * piece - self._size], flat.dtype)], 0)
            stacked = tf.reshape(flat, [replicas, piece])
        return aggregator_lib._restore_replicas(self._variable, stacked)


def wrap_optimizer(optimizer, stage, timeout_s=None, codec="none", error_feedback=True,
                   codec_options=None, aggregator=None):
    """Makes `optimizer` shard its state over replicas (ZeRO `stage` 1 or 2), in place.

    Args:
        optimizer: a Keras 3 `SGD` or `Adam` (amsgrad off, no EMA, no Keras gradient
            accumulation), not yet built, created under the strategy's scope.
        stage: 1 (optimizer state) or 2 (also gradients reduce-scattered).
        timeout_s: timeout of each collective.
        codec: `"none"` (fp32), or one of `CODECS`: the gradients' reduce-scatter travels
            in it (at either stage); or one of `AGGREGATED`, with `aggregator`.
        error_feedback: with a codec, each replica keeps what its message dropped and
            adds it to its next gradient (as the aggregators do).
        codec_options: lowbit's and top-k's parameters, `{"bits", "ratio",
            "dense_below"}` (`tfpar.zero.piece_codecs.make`); a true `"union"` (top-k's
            replicas' union, data parallelism's) gets one warning line: it has no effect.
        aggregator: for an `AGGREGATED` codec, the `tfpar.compression.Aggregator` that
            sums the whole gradient (built without Adam in front), of which each replica
            keeps its piece; or, with Adam and an `ADAM_FRONT` codec, that codec's
            aggregator with Adam in front (`make_aggregator(config)`): data parallelism's
            step, every replica applying the summed Adam steps (module docstring).

    Returns:
        the same optimizer.

    Raises:
        ConfigError: another optimizer or option, or stage not 1 or 2.
        ValueError: `aggregator` given without an `AGGREGATED` codec or Adam in front, or
            missing with one; Adam in front of another codec or optimizer.
    """
    if stage not in (1, 2):
        raise ConfigError("zero_stage", stage, "tf.distribute shards optimizer state (1) and "
                          "gradients (2); parameter sharding (3) runs on a DTensor mesh")
    supported = (isinstance(optimizer, (keras.optimizers.SGD, keras.optimizers.Adam))
                 and not getattr(optimizer, "amsgrad", False) and not optimizer.use_ema
                 and not optimizer.gradient_accumulation_steps)
    if not supported or type(optimizer).__name__ not in ("SGD", "Adam"):
        raise ConfigError("zero_stage", stage, f"needs keras SGD or Adam (no amsgrad, EMA or "
                          f"Keras accumulation), got {type(optimizer).__name__}")
    if optimizer.built:
        raise ConfigError("zero_stage", stage, "wrap the optimizer before it is built")
    if codec not in ("none",) + CODECS + AGGREGATED:
        raise ConfigError("compression", codec, "ZeRO's reduce-scatter compresses with "
                          f"{', '.join(CODECS + AGGREGATED)} (or none)")
    # A caller's mistake, not a user's setting (`make_optimizer` passes both).
    front = getattr(aggregator, "adam", None) is not None
    if (codec in AGGREGATED or front) != (aggregator is not None):
        raise ValueError(f"codec={codec!r} with aggregator={aggregator!r}: an aggregator "
                         f"goes with {', '.join(AGGREGATED)} (tfpar.compression."
                         "make_aggregator(config, adam_step=False)), or with Adam in front "
                         f"of {', '.join(ADAM_FRONT)} (make_aggregator(config))")
    if front and (codec not in ADAM_FRONT or type(optimizer).__name__ != "Adam"):
        raise ValueError(f"aggregator={aggregator!r} takes Adam in front of {codec!r}: "
                         f"that needs keras.optimizers.Adam and one of {', '.join(ADAM_FRONT)}"
                         f", got {type(optimizer).__name__}")
    if front:
        # Keras's Adam's own constants, as `tfpar.compression.wrap_optimizer` copies them.
        aggregator.adam = (float(optimizer.beta_1), float(optimizer.beta_2),
                           float(optimizer.epsilon))
        aggregator.set_adam_variance(aggregator.adam_variance, aggregator.adam_refresh_every)
        logging.warning(adam_front_line(codec))
    elif codec in ADAM_FRONT and isinstance(optimizer, keras.optimizers.Adam):
        logging.warning(adam_behind_line(codec))
    if codec == "topk" and (codec_options or {}).get("union") and not front:
        logging.warning(TOPK_UNION_LINE)
    patches.mix_in(optimizer, ZeroMixin)
    optimizer.tfpar_zero_codec = codec
    optimizer.tfpar_zero_codec_options = {"bits": LOWBIT_BITS, "ratio": TOPK_RATIO,
                                          "dense_below": TOPK_DENSE_BELOW,
                                          **(codec_options or {})}
    optimizer.tfpar_zero_aggregator = aggregator
    optimizer.tfpar_zero_error_feedback = bool(error_feedback)
    optimizer.tfpar_zero_stage = stage
    optimizer.tfpar_zero_timeout_s = timeout_s
    return optimizer
