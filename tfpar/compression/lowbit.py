"""Low-bit aggregator: `bits` bits per entry, with one fp32 scale per block of a tensor.

Every replica sends, per block of `block` consecutive entries of one tensor, a code of
`bits` bits per entry (bit plane by bit plane, 32 to an int32 word) and the block's scale;
the receiver decodes them and sums the replicas' decodings in replica order (every replica
gets the same bits). Error feedback carries what the codes missed into the next step, as in
1-bit SGD (Seide et al. 2014), EF-SignSGD (Karimireddy et al. 2019) and 1-bit Adam (Tang et
al. 2021). At the default 3 bits and 256 entries per scale: 3/32 + 1/256 of fp32's bytes,
~10× fewer (`--lowbit_bits`; why 3: docs/benchmarks/compression.md).

Blocks never straddle two tensors, so a bias's scale is its own, not its neighbour kernel's.
"""


import tensorflow as tf

from tfpar.compression import collectives
from tfpar.config import LOWBIT_BITS
from tfpar.compression.aggregator import Aggregator

BLOCK = 256


def block_count(sizes, block):
    """Blocks of tensors of `sizes` cut into blocks of `block` entries each (per tensor).

    >>> block_count([3, 2], 2)
    3
    """
    return sum(-(-size // block) for size in sizes)


def block_ids(sizes, block):
    """The block of each entry of tensors of `sizes` laid end to end, blocks cut per tensor
    (int32 `[sum(sizes)]`).

    >>> block_ids([3, 2], 2).numpy().tolist()
    [0, 0, 1, 2, 2]
    """
    ids, first = [], 0
    for size in sizes:
        ids.append(first + tf.range(size, dtype=tf.int32) // block)
        first += -(-size // block)
    return tf.concat(ids, 0)


def pack_bits(bits):
    """int32 0/1 `bits` `[..., n]` → int32 words `[..., ceil(n / 32)]`, bit j of word w =
    `bits[..., 32 w + j]`."""
    n = int(bits.shape[-1])
    pad = [[0, 0]] * (bits.shape.rank - 1) + [[0, (-n) % 32]]
    bits = tf.pad(tf.cast(bits, tf.int64), pad)
    bits = tf.reshape(bits, tf.concat([tf.shape(bits)[:-1], [-1, 32]], 0))
    words = tf.reduce_sum(tf.bitwise.left_shift(bits, tf.range(32, dtype=tf.int64)), axis=-1)
    return tf.bitcast(tf.cast(words, tf.uint32), tf.int32)


def unpack_bits(words, n):
    """Inverse of `pack_bits` for `[..., w]` words: int32 0/1 of shape `[..., n]`."""
    # An arithmetic shift copies the sign bit into the high bits; bit 0 is still bit j.
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[..., None], tf.range(32)), 1)
    lead = tf.shape(words)[:-1]
    return tf.reshape(bits, tf.concat([lead, [-1]], 0))[..., :n]


def words_per_plane(n):
    return -(-n // 32)


def _per_block(reduce, x, ids, count, block):
    """`reduce` ("max" or "mean") of `x` over each block: `[n]` by `ids` (blocks cut per
    tensor), or `[rows, n]`, each row one tensor cut into blocks of `block` entries (a
    DTensor mesh has no segment reductions: padded and reshaped there)."""
    if x.shape.rank == 1:
        op = tf.math.unsorted_segment_max if reduce == "max" else tf.math.unsorted_segment_mean
        return op(x, ids, count)
    n = int(x.shape[-1])
    blocks = tf.reshape(tf.pad(x, [[0, 0], [0, count * block - n]]), [-1, count, block])
    if reduce == "max":  # magnitudes: the zeros padded in change no maximum
        return tf.reduce_max(blocks, -1)
    lengths = [block] * (count - 1) + [n - (count - 1) * block]
    return tf.reduce_sum(blocks, -1) / tf.constant(lengths, tf.float32)


def encode(x, ids, count, bits=1, block=None):
    """`(words, scales)` of `x` in `bits` bits per entry, one scale per block: `x` is one
    message `[n]` (blocks by `ids`), or one per row `[rows, n]`, each row one tensor in
    blocks of `block` entries (the mesh's replicas, `tfpar.layout.reduction`); `words`
    `[..., bits · words_per_plane(n)]`, `scales` `[..., count]`.

    1 bit: the sign, decoded as `± scale` with `scale` the block's mean magnitude (the
    block's L1 norm kept). More bits: symmetric codes `-L..L` (`L = 2^(bits-1) - 1`) of
    `x / scale`, rounded to nearest, `scale` the block's largest magnitude over `L` (so 0
    is a code: an entry that is exactly 0 decodes to 0). The codes go bit plane by bit
    plane, `words_per_plane(n)` words each.
    """
    magnitude = tf.abs(x)
    if bits == 1:
        scales = _per_block("mean", magnitude, ids, count, block)
        return pack_bits(tf.cast(x >= 0, tf.int32)), scales
    top = 2 ** (bits - 1) - 1
    amax = _per_block("max", magnitude, ids, count, block)
    scales = tf.where(amax > 0, amax / top, tf.ones_like(amax))
    q = tf.cast(tf.clip_by_value(tf.round(x / tf.gather(scales, ids, axis=-1)), -top, top),
                tf.int32) + top
    planes = [pack_bits(tf.bitwise.bitwise_and(tf.bitwise.right_shift(q, j), 1))
              for j in range(bits)]
    return tf.concat(planes, -1), scales


def decode(words, scales, ids, n, bits=1):
    """The values `encode` sent, for `[..., bits · words_per_plane(n)]` words and
    `[..., blocks]` scales."""
    per_entry = tf.gather(scales, ids, axis=-1)
    w = words_per_plane(n)
    if bits == 1:
        return (tf.cast(unpack_bits(words, n), tf.float32) * 2 - 1) * per_entry
    q = tf.add_n([tf.bitwise.left_shift(unpack_bits(words[..., j * w:(j + 1) * w], n), j)
                  for j in range(bits)])
    return tf.cast(q - (2 ** (bits - 1) - 1), tf.float32) * per_entry


class LowBitAggregator(Aggregator):
    """Sends `bits` bits per entry and one fp32 scale per `block` entries of a tensor
    (`encode`: the sign and the mean magnitude at 1 bit; symmetric codes `-L..L` of the
    block's largest magnitude over `L = 2^(bits-1) - 1` from 2 bits, 0 among them).

    The codes of every replica are all-gathered (one int32 buffer per bucket: the code
    words, then the scales' bits) and summed locally. With Adam in front (the trainer's
    path and `tfpar.DistributedOptimizer`'s with Keras's Adam) each replica moves Adam's
    second moment with its own exact gradient and compresses its gradient over its own
    denominator; the momentum is taken of the sum (`adam_compresses = "gradient"`), so what
    error feedback holds back is applied later, never lost.

    Args:
        bits: bits per entry, 1 to 4 (default 3, the trainer's `--lowbit_bits`; int8 is
            `Int8Aggregator`).
        block: entries per scale, >= 1: each tensor is cut into blocks of this many (its
            last one shorter); a smaller block follows magnitudes more closely for 4 B
            more per block.
        **kwargs: see `Aggregator`.

    Examples:
        >>> agg = LowBitAggregator()
        >>> agg.bits, agg.block
        (3, 256)
    """

    lossy = True
    adam_compresses = "gradient"  # see `Aggregator.adam_compresses`

    def __init__(self, bits=LOWBIT_BITS, block=BLOCK, **kwargs):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block={block!r} is invalid: must be an integer >= 1 (entries "
                             "per scale), e.g. 256")
        if isinstance(bits, bool) or bits not in (1, 2, 3, 4):
            raise ValueError(f"bits={bits!r} is invalid: choose 1, 2, 3 or 4 (int8 is "
                             "compression='int8')")
        super().__init__(**kwargs)
        self.block = block
        self.bits = bits

    def _exchange_bucket(self, flat, bucket):
        n = int(flat.shape[0])
        ids, count = block_ids(bucket.sizes, self.block), block_count(bucket.sizes, self.block)
        words, scales = encode(flat, ids, count, self.bits)
        message = tf.concat([words, tf.bitcast(scales, tf.int32)], 0)
        rows, nbytes = collectives.gather_rows(message, self.collective_options)
        replicas = collectives.replica_context().num_replicas_in_sync
        decoded = decode(rows[:, :-count], tf.bitcast(rows[:, -count:], tf.float32), ids, n,
                         self.bits)
        # add_n over rows in replica order: every replica sums identically.
        summed = tf.add_n(tf.unstack(decoded, num=replicas))
        return summed, decode(words, scales, ids, n, self.bits), nbytes

    def _bucket_wire_bytes(self, bucket):
        return 4 * (self.bits * words_per_plane(bucket.size)
                    + block_count(bucket.sizes, self.block))

    def get_config(self):
        return {**super().get_config(), "block": self.block, "bits": self.bits}
