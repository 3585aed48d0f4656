"""Dense aggregators: every gradient entry is sent, as fp32 (`none`), fp16/bf16, or int8."""

import math

import tensorflow as tf

from tfpar.compression import codecs, collectives
from tfpar.compression.aggregator import Aggregator


class NoneAggregator(Aggregator):
    """The reference: a plain fp32 all-reduce per bucket (what Keras does, but bucketed).

    Examples:
        >>> optimizer = wrap_optimizer(keras.optimizers.Adam(), NoneAggregator())  # doctest: +SKIP
    """

    # Embeddings' `IndexedSlices` gradients: summed densely in the buckets (False: the path
    # every lossy aggregator takes, the quality suite's fp32 reference), or (True: the
    # trainer's bucketed `--compression=none` across workers) through tf.distribute's own
    # sum as Keras sends them (the slices gathered), so Keras's Adam adds one square per
    # slice as without buckets (summed densely first, the transformer's loss moved 5-9 %:
    # docs/guides/compression.md, "The reference is fp32 through the exact aggregator").
    keras_slices = False

    def all_reduce_sum(self, grads, variables):
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        if not (self.keras_slices and sparse) or self.adam is not None:
            return super().all_reduce_sum(grads, variables)
        out = super().all_reduce_sum(
            [None if i in sparse else g for i, g in enumerate(grads)], variables)
        summed = collectives.replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, [grads[i] for i in sparse])
        for i, s in zip(sparse, summed):
            out[i] = s
        return out

    @property
    def checkpointed(self):
        # Without Adam in front its state (a step counter, a byte count) changes no result:
        # a multi-worker `--compression=none` run (bucketed) and a one-process run (Keras's
        # all-reduce) then load each other's checkpoints. Its lossy subclasses (PowerSGD,
        # `auto`) keep residuals and Qs: those were left out of checkpoints with SGD.
        return self.lossy or self.adam is not None

    def _exchange_bucket(self, flat, bucket):
        total, nbytes = collectives.sum_all(flat, self.collective_options)
        return total, None, nbytes

    def _bucket_wire_bytes(self, bucket):
        return 4 * bucket.size


class CastAggregator(Aggregator):
    """All-reduce in a 16-bit float: half the bytes of fp32.

    Args:
        dtype: `"fp16"` or `"bf16"` (the collective sums in this dtype; gradients are
            already divided by the number of replicas, so fp16 overflow needs values near
            65504 times that number).
        **kwargs: see `Aggregator`.
    """

    lossy = True
    DTYPES = {"fp16": tf.float16, "bf16": tf.bfloat16}

    def __init__(self, dtype="fp16", **kwargs):
        if dtype not in self.DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid: choose one of fp16, bf16")
        super().__init__(**kwargs)
        self.dtype_name = dtype
        self.wire_dtype = self.DTYPES[dtype]

    def _exchange_bucket(self, flat, bucket):
        sent = tf.cast(flat, self.wire_dtype)
        total, nbytes = collectives.sum_all(sent, self.collective_options)
        return tf.cast(total, tf.float32), tf.cast(sent, tf.float32), nbytes

    def _bucket_wire_bytes(self, bucket):
        return 2 * bucket.size

    def get_config(self):
        return {**super().get_config(), "dtype": self.dtype_name}


class Int8Aggregator(Aggregator):
    """int8 codes with one fp32 scale per `block` entries, all-gathered and summed locally.

    int8 cannot be summed in a collective without overflow (and `CollectiveGatherV2`
    rejects int8), so each replica's codes travel as int32 words of 4 codes with the scales'
    bits in extra words: one all-gather per bucket, about 1/4 of fp32 (256 entries per scale:
    1/4 + 1/256).

    One scale per bucket (the previous design) rounded every entry below 1/254 of the
    bucket's largest to zero: a 4 MiB bucket holds many layers, so a layer whose gradients are
    small next to another's (norms, biases, a convnet's first kernels) sent nothing most
    steps and error feedback released it as a spike every few steps, which Adam, normalising
    by the spikes' root mean square, turns into slower steps (docs/guides/compression.md). A scale
    per 256 entries keeps each
    block's resolution within 1/254 of its own largest entry.

    Args:
        stochastic_rounding: round up or down at random (unbiased) instead of to nearest.
        block: entries per scale (`None`: one scale per bucket, the previous design).
        **kwargs: see `Aggregator`.
    """

    lossy = True
    BLOCK = 256

    def __init__(self, stochastic_rounding=False, block=BLOCK, **kwargs):
        super().__init__(**kwargs)
        self.stochastic_rounding = bool(stochastic_rounding)
        if block is not None and (not isinstance(block, int) or block < 1):
            raise ValueError(f"block={block!r} is invalid: must be an integer >= 1 (entries "
                             "per scale) or None (one scale per bucket)")
        self.block = block

    def _exchange_bucket(self, flat, bucket):
        ctx = collectives.replica_context()
        n = flat.shape[0]
        seed = None
        if self.stochastic_rounding:
            # Different on every replica and step, repeatable across runs.
            seed = tf.stack([tf.cast(self.step, tf.int32),
                             tf.cast(ctx.replica_id_in_sync_group, tf.int32) + 1000 * n])
        block = self.block or n
        codes, scales = codecs.quantize_int8_blocks(flat, block, seed)
        nscales = codecs.int8_blocks(n, block)
        words = tf.concat([codecs.pack_int8(codes), tf.bitcast(scales, tf.int32)], 0)
        rows, nbytes = collectives.gather_rows(words, self.collective_options)  # [replicas, n/4 + blocks]
        all_scales = tf.bitcast(rows[:, -nscales:], tf.float32)
        decoded = codecs.dequantize_int8_blocks(codecs.unpack_int8(rows[:, :-nscales], n),
                                                all_scales, block, n)
        # add_n over rows in replica order: every replica sums identically.
        summed = tf.add_n(tf.unstack(decoded, num=ctx.num_replicas_in_sync))
        return summed, codecs.dequantize_int8_blocks(codes, scales, block, n), nbytes

    def _bucket_wire_bytes(self, bucket):
        return 4 * (math.ceil(bucket.size / 4) + codecs.int8_blocks(bucket.size,
                                                                    self.block or bucket.size))

    def get_config(self):
        return {**super().get_config(), "stochastic_rounding": self.stochastic_rounding,
                "block": self.block}
