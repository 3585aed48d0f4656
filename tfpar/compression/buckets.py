"""Buckets: many small gradients fused into few flat buffers, one collective per buffer.

A `Bucket` is a static plan (which tensors, their shapes and offsets); `plan_buckets` makes
it from shapes alone, so it is decided once at trace time and identical on every replica.
"""

import dataclasses
import math

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors `positions` (indices into the caller's list) laid end to end.

    Attributes:
        positions: indices of the member tensors in the caller's list.
        shapes: their static shapes.
        size: total number of elements.
    """
    positions: tuple
    shapes: tuple

    @property
    def sizes(self):
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def size(self):
        return sum(self.sizes)


def plan_buckets(shapes, bucket_bytes, itemsize=4, order=None):
    """Greedily groups tensors into buckets, closing a bucket as soon as it holds at least
    `bucket_bytes` (as PyTorch DDP's `bucket_cap_mb`): a layer's bias and kernel, produced
    together by backward, share a bucket instead of the bias getting a collective of its
    own, and a tensor larger than the budget closes its bucket alone or with a few small
    ones before it.

    Args:
        shapes: static shapes (lists/tuples/TensorShapes of ints) of the tensors.
        bucket_bytes: byte threshold at which a bucket is closed.
        itemsize: bytes per element used for the budget.
        order: positions in the order to fill buckets (default: reversed, because backward
            produces the last layers' gradients first, so their bucket can be sent first).

    Returns:
        list of `Bucket`.
    """
    shapes = [tuple(int(d) for d in s) for s in shapes]
    order = list(reversed(range(len(shapes)))) if order is None else list(order)
    buckets, cur, cur_bytes = [], [], 0
    for i in order:
        cur.append(i)
        cur_bytes += math.prod(shapes[i]) * itemsize
        if cur_bytes >= bucket_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        buckets.append(cur)
    return [Bucket(tuple(b), tuple(shapes[i] for i in b)) for b in buckets]


def pack(tensors, bucket, dtype=tf.float32):
    """Flattens the bucket's members of `tensors` into one 1-D `dtype` buffer."""
    return tf.concat([tf.reshape(tf.cast(tensors[i], dtype), [-1]) for i in bucket.positions], 0)


def unpack(flat, bucket):
    """Inverse of `pack`: `{position: tensor of its shape}` cut out of `flat`."""
    parts = tf.split(flat, list(bucket.sizes)) if len(bucket.positions) > 1 else [flat]
    return {i: tf.reshape(p, s) for i, p, s in zip(bucket.positions, parts, bucket.shapes)}
