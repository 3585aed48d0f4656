"""Dense aggregators: every gradient entry is sent, as fp32 (`none`), fp16/bf16, or int8."""

import math

import tensorflow as tf

from tfpar.compression import codecs, collectives
from tfpar.compression.aggregator import Aggregator


class NoneAggregator(Aggregator):
    """The reference: a plain fp32 all-reduce per bucket (what Keras does, but bucketed).

    Example:
    >>> optimizer = wrap_optimizer(keras.optimizers.Adam(), NoneAggregator())  # doctest: +SKIP
    """

    def _exchange_bucket(self, flat, bucket):
        total, nbytes = collectives.sum_all(flat, self._opts)
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
        total, nbytes = collectives.sum_all(sent, self._opts)
        return tf.cast(total, tf.float32), tf.cast(sent, tf.float32), nbytes

    def _bucket_wire_bytes(self, bucket):
        return 2 * bucket.size

    def get_config(self):
        return {**super().get_config(), "dtype": self.dtype_name}


class Int8Aggregator(Aggregator):
    """int8 codes with one fp32 scale per bucket, all-gathered and summed locally.

    int8 cannot be summed in a collective without overflow (and `CollectiveGatherV2`
    rejects int8), so each replica's codes travel as int32 words of 4 codes with the scale's
    bits in one extra word: one all-gather per bucket, about 1/4 of fp32.

    Args:
        stochastic_rounding: round up or down at random (unbiased) instead of to nearest.
        **kwargs: see `Aggregator`.
    """

    lossy = True

    def __init__(self, stochastic_rounding=False, **kwargs):
        super().__init__(**kwargs)
        self.stochastic_rounding = bool(stochastic_rounding)

    def _exchange_bucket(self, flat, bucket):
        ctx = collectives.replica_context()
        n = flat.shape[0]
        seed = None
        if self.stochastic_rounding:
            # Different on every replica and step, repeatable across runs.
            seed = tf.stack([tf.cast(self.step, tf.int32),
                             tf.cast(ctx.replica_id_in_sync_group, tf.int32) + 1000 * n])
        codes, scale = codecs.quantize_int8(flat, seed)
        words = tf.concat([codecs.pack_int8(codes), tf.bitcast(scale, tf.int32)[None]], 0)
        rows, nbytes = collectives.gather_rows(words, self._opts)  # [replicas, n/4 + 1]
        scales = tf.bitcast(rows[:, -1], tf.float32)
        decoded = codecs.dequantize_int8(codecs.unpack_int8(rows[:, :-1], n), scales[:, None])
        # add_n over rows in replica order: every replica sums identically.
        summed = tf.add_n(tf.unstack(decoded, num=ctx.num_replicas_in_sync))
        return summed, codecs.dequantize_int8(codes, scale), nbytes

    def _bucket_wire_bytes(self, bucket):
        return 4 * (math.ceil(bucket.size / 4) + 1)

    def get_config(self):
        return {**super().get_config(), "stochastic_rounding": self.stochastic_rounding}
