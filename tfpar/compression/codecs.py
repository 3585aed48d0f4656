"""Codecs: what a lossy aggregator does to one flat fp32 buffer before it goes on the wire.

Plain TensorFlow ops on 1-D float tensors, no strategy needed; the aggregators in
`tfpar.compression` run them per bucket and hand the encoded buffers to the collectives.
`CollectiveGatherV2` rejects int8, so int8 codes travel as int32 words holding 4 codes each
(`pack_int8`), and sparse (value, index) pairs travel as one int32 buffer (`pack_sparse`).
"""

import tensorflow as tf

INT8_MAX = 127.0


def cast_roundtrip(x, dtype):
    """`x` as it arrives after a trip through `dtype` (fp16/bf16) and back to `x.dtype`."""
    return tf.cast(tf.cast(x, dtype), x.dtype)


def quantize_int8(x, seed=None):
    """Symmetric int8 quantisation with one scale for the whole buffer.

    Args:
        x: float tensor (any shape).
        seed: optional int32 `[2]` seed; with it values are rounded stochastically (unbiased:
            E[dequantize(q)] == x), without it to the nearest code.

    Returns:
        `(codes, scale)`: int8 tensor of `x`'s shape in [-127, 127] and a float32 scalar with
        `x ≈ codes * scale`; `|x - codes * scale| <= scale / 2` when rounding to nearest.
    """
    x = tf.cast(x, tf.float32)
    amax = tf.reduce_max(tf.abs(x))
    return _quantize(x, amax, seed)


def _quantize(x, amax, seed):
    # An all-zero buffer still needs a finite scale; any positive value decodes to zeros.
    scale = tf.where(amax > 0, amax / INT8_MAX, tf.ones_like(amax))
    y = x / scale
    if seed is None:
        y = tf.round(y)
    else:
        y = tf.floor(y + tf.random.stateless_uniform(tf.shape(y), seed))
    return tf.cast(tf.clip_by_value(y, -INT8_MAX, INT8_MAX), tf.int8), scale


def int8_blocks(n, block):
    """How many scales `quantize_int8_blocks` sends for `n` entries in blocks of `block`."""
    return -(-n // block)


def quantize_int8_blocks(x, block, seed=None):
    """Symmetric int8 quantisation of 1-D `x` with one scale per `block` consecutive entries
    (the last block may be shorter), so a small-gradient layer sharing a bucket with a large
    one keeps its own resolution instead of rounding to zero.

    Returns:
        `(codes, scales)`: int8 `[n]` and float32 `[int8_blocks(n, block)]`;
        `|x - dequantize_int8_blocks(codes, scales, block)| <= scale of its block / 2` when
        rounding to nearest.
    """
    x = tf.cast(x, tf.float32)
    n = int(x.shape[0])
    rows = tf.reshape(tf.pad(x, [[0, (-n) % block]]), [-1, block])
    codes, scales = _quantize(rows, tf.reduce_max(tf.abs(rows), axis=1, keepdims=True), seed)
    return tf.reshape(codes, [-1])[:n], tf.reshape(scales, [-1])


def dequantize_int8_blocks(codes, scales, block, n):
    """Inverse of `quantize_int8_blocks` for `[..., n]` codes and `[..., blocks]` scales."""
    per_entry = tf.repeat(scales, block, axis=-1)[..., :n]
    return tf.cast(codes, tf.float32) * per_entry


def dequantize_int8(codes, scale):
    """Inverse of `quantize_int8`: float32 `codes * scale` (scale broadcasts)."""
    return tf.cast(codes, tf.float32) * scale


def pack_int8(codes):
    """Packs a 1-D int8 tensor into int32 words, 4 codes per word (zero-padded).

    Returns:
        int32 tensor of shape `[ceil(n / 4)]`.
    """
    n = tf.size(codes)
    padded = tf.pad(codes, [[0, (-n) % 4]])
    return tf.bitcast(tf.reshape(padded, [-1, 4]), tf.int32)


def unpack_int8(words, n):
    """Inverse of `pack_int8`: the first `n` int8 codes held in int32 `words` (any leading
    dims are kept: `[..., w] -> [..., n]`)."""
    codes = tf.bitcast(words, tf.int8)  # [..., w, 4]
    lead = tf.shape(words)[:-1]
    codes = tf.reshape(codes, tf.concat([lead, [-1]], 0))
    return codes[..., :n]


def topk(x, k):
    """The `k` entries of 1-D `x` with the largest magnitude.

    Returns:
        `(values, indices)`: `x`'s dtype and int32, each of shape `[k]`.
    """
    _, indices = tf.math.top_k(tf.abs(x), k=k, sorted=False)
    return tf.gather(x, indices), indices


def topk_sampled(x, k, seed, sample=16384, margin=1.3):
    """The `k` largest-magnitude entries of a large 1-D `x`, cheaper than `topk`.

    `tf.math.top_k` on a million entries is slow on a CPU core. Instead the threshold
    that keeps `margin × k` entries is estimated from `sample` random entries, the entries
    above it are kept (one cheap pass), and `top_k` runs on those few candidates only. When
    there are at least `k` candidates — nearly always: missing `k` needs the estimate to be
    off by several standard deviations — the result is exactly `topk(x, k)`. Otherwise the
    message is padded with `(0.0, index 0)` pairs, which add nothing when densified; error
    feedback carries the entries not sent, so a rare short message only delays them.

    Args:
        x: 1-D float tensor of static length `n`.
        k: entries to send (`k <= n`): a Python int, or an int32 scalar tensor when it
            changes from step to step (top-k's density warm-up).
        seed: int32 `[2]` seed of the sample (e.g. step and tensor position).
        sample, margin: sample size, and how many candidates to aim for (× k).

    Returns:
        `(values, indices)` of shape `[k]`, as `topk`.
    """
    n = int(x.shape[0])
    magnitude = tf.abs(x)
    if n <= 4 * sample:
        return topk(x, k)
    picks = tf.random.stateless_uniform([sample], seed, maxval=n, dtype=tf.int32)
    if isinstance(k, int):
        keep = min(sample, max(1, round(margin * k * sample / n)))
    else:
        keep = tf.cast(tf.round(margin * tf.cast(k, tf.float64) * sample / n), tf.int32)
        keep = tf.clip_by_value(keep, 1, sample)
    cut = tf.math.top_k(tf.gather(magnitude, picks), keep, sorted=True).values[-1]
    candidates = tf.cast(tf.reshape(tf.where(magnitude >= cut), [-1]), tf.int32)
    short = tf.maximum(k - tf.size(candidates), 0)
    candidates = tf.pad(candidates, [[0, short]])  # index 0 ...
    weights = tf.pad(tf.gather(magnitude, candidates[:tf.size(candidates) - short]),
                     [[0, short]], constant_values=-1.0)  # ... ranked last, sent as 0.0
    _, best = tf.math.top_k(weights, k=k, sorted=False)
    indices = tf.gather(candidates, best)
    values = tf.where(tf.gather(weights, best) >= 0, tf.gather(x, indices), tf.zeros([], x.dtype))
    return values, indices


def threshold(x, tau):
    """The entries of 1-D `x` with `|x| >= tau`; how many is data dependent.

    Returns:
        `(values, indices)`: `x`'s dtype and int32, each of shape `[count]`.
    """
    indices = tf.cast(tf.reshape(tf.where(tf.abs(x) >= tau), [-1]), tf.int32)
    return tf.gather(x, indices), indices


def densify(values, indices, n):
    """Scatters sparse `(values, indices)` into a dense 1-D tensor of length `n` (duplicate
    indices add up, so padding with index 0 and value 0 is harmless)."""
    return tf.scatter_nd(indices[:, None], values, [n])


def pack_sparse(values, indices):
    """One int32 buffer `[values bits..., indices...]` so a sparse message needs one all-gather.

    Args:
        values: float32 `[k]`; indices: int32 `[k]`.

    Returns:
        int32 `[2k]`.
    """
    return tf.concat([tf.bitcast(tf.cast(values, tf.float32), tf.int32), indices], 0)


def unpack_sparse(words):
    """Inverse of `pack_sparse` for `[..., 2k]` words: `(values float32, indices int32)`."""
    k = tf.shape(words)[-1] // 2
    return tf.bitcast(words[..., :k], tf.float32), words[..., k:]
