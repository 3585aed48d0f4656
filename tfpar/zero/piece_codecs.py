"""The sparse and low-bit codecs of ZeRO 1/2's reduce-scatter (`tfpar.zero.sharded`).

ZeRO 1/2 cut the flat padded gradient into `n` equal pieces, one per owner; each replica
sends piece `r` to replica `r` only (an all-to-all), so a codec here codes each piece on its
own, for its one receiver, and every replica's message to an owner must have one length.
Two codecs beside `sharded`'s casts and int8:

- `LowBitPieces` (`--compression=lowbit`): `tfpar.compression.lowbit`'s own `encode` and
  `decode`, `bits` bits per entry and one fp32 scale per 256 entries, with blocks cut per
  tensor inside each piece (a bias keeps its own scale, as on data parallelism); the
  pieces cut the tensors differently, so their scales are padded to the largest count.
- `TopKPieces` (`--compression=topk`): per piece, each tensor's part sends its `ratio`
  largest-magnitude entries (at least one; a part of at most `dense_below` entries goes
  whole), as (value, index) pairs, padded to the longest piece's count with `(0.0, 0)`
  pairs, which add nothing. Per tensor part, not per piece: a layer whose gradients are
  small next to another's still moves every step (`TopKAggregator`'s reason). There is no
  union of the replicas' indices (it needs an all-gather of every replica's indices, the
  traffic a reduce-scatter avoids): each owner sums what arrives, and error feedback keeps
  the rest. At ratio 1 every entry is sent and the sum is uncompressed ZeRO's, bit for bit.

Each codec: `encode(rows, step)` → `[n, W]` int32 messages (row `r` for owner `r`),
`decode(received, rank)` → `[n, S]` float32 (the `n` messages an owner of piece `rank`
received), `decode_own(sent)` → `[n, S]` (what this replica's own messages decode to, for
error feedback).
"""

import math

import tensorflow as tf

from tfpar.compression import codecs, lowbit


def piece_parts(sizes, piece, n):
    """Per piece `r` of `n`, `[(offset, length, is_padding)]`: where the tensors of `sizes`
    (laid end to end, then padded to `n * piece`) cut it, offsets inside the piece.

    >>> piece_parts([3, 5], 4, 2)
    [[(0, 3, False), (3, 1, False)], [(0, 4, False)]]
    >>> piece_parts([5], 3, 2)
    [[(0, 3, False)], [(0, 2, False), (2, 1, True)]]
    """
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size, False))
        start += size
    if start < n * piece:
        bounds.append((start, n * piece, True))
    rows = []
    for r in range(n):
        lo, hi, row = r * piece, (r + 1) * piece, []
        for a, b, padding in bounds:
            a, b = max(a, lo), min(b, hi)
            if a < b:
                row.append((a - lo, b - a, padding))
        rows.append(row)
    return rows


class LowBitPieces:
    """`bits`-bit codes of each piece, one fp32 scale per `block` entries of a tensor's part.

    Args:
        sizes: entries of each tensor, in flat order (`FlatLayout.sizes`).
        n: replicas (pieces); piece: entries per piece.
        bits: 1 to 4 (`--lowbit_bits`).
        block: entries per scale.
    """

    def __init__(self, sizes, n, piece, bits, block=lowbit.BLOCK):
        self.n, self.piece, self.bits, self.block = n, piece, bits, block
        self.lengths = [[length for _, length, _ in row] for row in piece_parts(sizes, piece, n)]
        self.counts = [lowbit.block_count(lengths, block) for lengths in self.lengths]
        self.width = max(self.counts)  # scales per message, padded

    def _ids(self, r):
        """The block of each entry of piece `r` (a number, or a scalar tensor: a replica's
        id, known when its step is traced), int32 `[piece]`: only that piece's are built
        (building every piece's to gather one cost n times the ops; expanding them from
        block lengths cut once, with `tf.repeat`, measured 2x slower than this)."""
        static = tf.get_static_value(r)
        if static is not None:
            return lowbit.block_ids(self.lengths[int(static)], self.block)
        return tf.gather(tf.stack([lowbit.block_ids(lengths, self.block)
                                   for lengths in self.lengths]), r)

    def message_words(self):
        """int32 words of one piece's message."""
        return self.bits * lowbit.words_per_plane(self.piece) + self.width

    def encode(self, rows, step=None):
        del step
        out = []
        for r in range(self.n):
            words, scales = lowbit.encode(rows[r], self._ids(r), self.counts[r], self.bits)
            scales = tf.pad(scales, [[0, self.width - self.counts[r]]], constant_values=1.0)
            out.append(tf.concat([words, tf.bitcast(scales, tf.int32)], 0))
        return tf.stack(out)

    def _decode(self, words, ids):
        scales = tf.bitcast(words[..., -self.width:], tf.float32)
        return lowbit.decode(words[..., :-self.width], scales, ids, self.piece, self.bits)

    def decode(self, received, rank):
        # Every message an owner receives is of its own piece: one block layout, its rank's.
        return self._decode(received, self._ids(rank))

    def decode_own(self, sent):
        return tf.stack([self._decode(sent[r], self._ids(r)) for r in range(self.n)])


class TopKPieces:
    """Each piece's entries, `ratio` of each tensor's part, as (value, index) pairs.

    Args:
        sizes: entries of each tensor, in flat order; n: replicas; piece: entries per piece.
        ratio: fraction of each part sent, in (0, 1] (`--topk_ratio`).
        dense_below: parts of at most this many entries are sent whole
            (`--topk_dense_below`).
    """

    def __init__(self, sizes, n, piece, ratio, dense_below):
        self.n, self.piece = n, piece
        self.parts = []  # per piece: (offset, length, k), padding left out
        for row in piece_parts(sizes, piece, n):
            self.parts.append([
                (offset, length, length if length <= dense_below
                 else min(length, max(1, math.ceil(ratio * length))))
                for offset, length, padding in row if not padding])
        self.k = max(1, max(sum(k for _, _, k in row) for row in self.parts))

    def message_words(self):
        return 2 * self.k

    def encode(self, rows, step):
        out = []
        for r in range(self.n):
            values, indices = [], []
            for offset, length, k in self.parts[r]:
                part = rows[r][offset:offset + length]
                if k == length:
                    v, i = part, tf.range(length)
                else:  # a large part: exact top-k through a sampled threshold
                    v, i = codecs.topk_sampled(part, k, tf.stack(
                        [tf.cast(step, tf.int32), r * self.piece + offset]))
                values.append(v)
                indices.append(i + offset)
            short = self.k - sum(k for _, _, k in self.parts[r])
            values.append(tf.zeros([short]))
            indices.append(tf.zeros([short], tf.int32))
            out.append(codecs.pack_sparse(tf.concat(values, 0), tf.concat(indices, 0)))
        return tf.stack(out)

    def decode(self, received, rank=None):
        del rank  # the indices say where
        values, indices = codecs.unpack_sparse(received)
        return tf.stack([codecs.densify(values[j], indices[j], self.piece)
                         for j in range(self.n)])

    def decode_own(self, sent):
        return self.decode(sent)


def make(codec, sizes, n, piece, options):
    """The piece codec `codec` names (`"lowbit"` or `"topk"`), or None for the others.

    Args:
        options: `{"bits", "ratio", "dense_below"}` (the trainer's `--lowbit_bits`,
            `--topk_ratio`, `--topk_dense_below`).
    """
    if codec == "lowbit":
        return LowBitPieces(sizes, n, piece, options["bits"])
    if codec == "topk":
        return TopKPieces(sizes, n, piece, options["ratio"], options["dense_below"])
    return None
