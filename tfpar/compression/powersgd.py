"""PowerSGD maths (Vogels et al., 2019): one step of power iteration per training step.

A gradient `M` (reshaped to `n × m`) is sent as two thin factors: `P = M Q` (`n × r`),
orthogonalised to `P̂`, then `Q' = Mᵀ P̂` (`m × r`); the receiver rebuilds `P̂ Q'ᵀ`. Both
factors are linear in `M`, so summing them over replicas gives the factors of the summed
gradient. `Q'` warm-starts the next step, which is what makes a single iteration enough.
Vectors and small matrices, where `(n + m) r >= n m`, are not worth compressing.
"""

import math

import tensorflow as tf


def matrix_shape(shape):
    """The 2-D view PowerSGD uses: the linear map a weight applies, inputs × outputs.

    A conv kernel `[kh, kw, cin, cout]` maps patches to channels: `[kh·kw·cin, cout]`.
    Other tensors are split into leading dims (rows) and trailing dims (columns) where rows
    + columns is smallest, which makes the factors smallest: an attention kernel
    `[width, heads, head_dim]` becomes `[width, heads·head_dim]` (folding all leading dims
    would give a tall `[width·heads, head_dim]` whose rank-r factors are ~4× larger).

    >>> matrix_shape([3, 3, 16, 32]), matrix_shape([256, 4, 64]), matrix_shape([4, 64, 256])
    ((144, 32), (256, 256), (256, 256))
    """
    shape = [int(d) for d in shape]
    if len(shape) in (1, 2, 4):
        return math.prod(shape[:-1]), shape[-1]
    splits = [(math.prod(shape[:k]), math.prod(shape[k:])) for k in range(1, len(shape))]
    return min(reversed(splits), key=sum)  # ties: the later split


def effective_rank(shape, rank):
    """`rank` capped by the matrix size."""
    n, m = matrix_shape(shape)
    return min(rank, n, m)


def compressible(shape, rank):
    """Whether a tensor of `shape` is sent as rank-`rank` factors: a matrix (2+ dims) whose
    factors are smaller than itself."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    r = effective_rank(shape, rank)
    return (n + m) * r < n * m


def initial_q(m, rank, seed):
    """A random `m × rank` start for `Q`; the same `seed` gives the same matrix everywhere,
    which every replica needs because `Q` multiplies each replica's own gradient."""
    return tf.random.stateless_normal([m, rank], seed=[seed, 0])


def orthogonalize(p):
    """An orthonormal basis of `p`'s columns (`n × r`, reduced QR), so that `P̂ P̂ᵀ M` is the
    projection of `M` on the columns' span."""
    q, _ = tf.linalg.qr(p)
    return q


def compress_p(matrix, q):
    """First factor, before the sum over replicas: `M Q`."""
    return tf.matmul(matrix, q)


def compress_q(matrix, p_hat):
    """Second factor, before the sum over replicas: `Mᵀ P̂`, computed as `(P̂ᵀ M)ᵀ`: the
    same products (equal up to rounding), where TensorFlow's CPU kernel for `Mᵀ P̂` walked
    `M` column-wise (2.6 ms against 2.0 ms for a 6.3 M-parameter MLP's matrices at rank 4,
    one process)."""
    return tf.transpose(tf.matmul(p_hat, matrix, transpose_a=True))


def decompress(p_hat, q):
    """The rank-r approximation `P̂ Qᵀ`."""
    return tf.matmul(p_hat, q, transpose_b=True)


def nonzero_or(q_new, q):
    """`q_new`, or `q` where `q_new` is all zero: a zero gradient's `Q` would stay zero on
    every later step. (The condition as [1, 1]: DTensor crashed on a scalar condition,
    TF 2.21.)"""
    return tf.where(tf.reshape(tf.reduce_any(q_new != 0), [1, 1]), q_new, q)


def approximate(matrix, q):
    """One PowerSGD round trip on a single replica.

    Args:
        matrix: `n × m` float32.
        q: `m × r` warm start.

    Returns:
        `(approximation, new_q)`; exact (up to rounding) when `rank(matrix) <= r`.
    """
    p_hat = orthogonalize(compress_p(matrix, q))
    new_q = compress_q(matrix, p_hat)
    return decompress(p_hat, new_q), new_q
