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
    """The 2-D view PowerSGD uses: all leading dims folded into rows (`[kh, kw, cin, cout]`
    -> `[kh·kw·cin, cout]`)."""
    shape = [int(d) for d in shape]
    return math.prod(shape[:-1]), shape[-1]


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
    """Second factor, before the sum over replicas: `Mᵀ P̂`."""
    return tf.matmul(matrix, p_hat, transpose_a=True)


def decompress(p_hat, q):
    """The rank-r approximation `P̂ Qᵀ`."""
    return tf.matmul(p_hat, q, transpose_b=True)


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
