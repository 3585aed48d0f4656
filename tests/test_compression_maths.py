"""Pure maths of the gradient codecs: no strategy, plain TensorFlow ops."""

import numpy as np
import pytest
import tensorflow as tf

from tfpar import ParallelConfig
from tfpar.compression import (PowerSGDAggregator, TopKAggregator, buckets, codecs,
                               error_feedback, lowbit, make_aggregator, powersgd, sparse)
from tfpar.errors import ConfigError


def _rand(*shape, seed=0):
    return tf.constant(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


@pytest.mark.parametrize("dtype,rel", [(tf.float16, 2 ** -11), (tf.bfloat16, 2 ** -8)])
def test_cast_roundtrip_relative_error(dtype, rel):
    x = _rand(10000)
    y = codecs.cast_roundtrip(x, dtype)
    assert y.dtype == tf.float32
    assert np.max(np.abs((y - x) / x)) <= rel


def test_int8_nearest_error_within_half_step():
    x = _rand(5000)
    codes, scale = codecs.quantize_int8(x)
    assert codes.dtype == tf.int8
    err = np.abs(codecs.dequantize_int8(codes, scale) - x)
    assert float(np.max(err)) <= float(scale) / 2 + 1e-7
    assert float(scale) == pytest.approx(float(tf.reduce_max(tf.abs(x))) / 127)


def test_int8_stochastic_is_unbiased():
    x = tf.fill([20000], 0.3) * tf.constant(1.0)
    x = tf.concat([x, [1.0]], 0)  # scale = 1/127, 0.3 sits between codes 38 and 39
    codes, scale = codecs.quantize_int8(x, seed=tf.constant([1, 2]))
    y = codecs.dequantize_int8(codes, scale)[:-1]
    assert set(np.unique(codes[:-1].numpy())) == {38, 39}
    assert float(tf.reduce_mean(y)) == pytest.approx(0.3, abs=2e-4)


def test_int8_all_zero_buffer():
    codes, scale = codecs.quantize_int8(tf.zeros([7]))
    assert np.all(codecs.dequantize_int8(codes, scale).numpy() == 0)


def test_int8_blocks_keep_each_block_own_resolution():
    # A small-gradient layer (1e-4) next to a large one (1.0) in one buffer: one scale for
    # the buffer rounds the small one to zero, a scale per block keeps it within 1/254.
    small, large = 1e-4 * _rand(300, seed=1), _rand(700, seed=2)
    x = tf.concat([small, large], 0)
    codes, scale = codecs.quantize_int8(x)
    assert np.all(codecs.dequantize_int8(codes, scale)[:256].numpy() == 0)
    codes, scales = codecs.quantize_int8_blocks(x, 256)
    assert codes.shape == [1000] and scales.shape == [codecs.int8_blocks(1000, 256)] == [4]
    y = codecs.dequantize_int8_blocks(codes, scales, 256, 1000).numpy()
    blocks = np.split(np.pad(x.numpy(), [0, 24]), 4)
    bound = np.repeat([np.max(np.abs(b)) / 254 for b in blocks], 256)[:1000]
    assert np.all(np.abs(y - x.numpy()) <= bound + 1e-9)
    assert np.max(np.abs(y[:256] - x.numpy()[:256])) <= 1e-4 * 5 / 254
    # Rows of several replicas decode row by row.
    rows = codecs.dequantize_int8_blocks(tf.stack([codes, codes]), tf.stack([scales, scales]),
                                         256, 1000)
    np.testing.assert_array_equal(rows[1], y)


@pytest.mark.parametrize("block", [0, -1, 2.5, "256"])
def test_int8_block_must_be_a_positive_integer(block):
    from tfpar.compression.dense import Int8Aggregator
    with pytest.raises(ValueError, match=f"block={block!r} is invalid"):
        Int8Aggregator(block=block)


@pytest.mark.parametrize("n", [1, 4, 5, 1023])
def test_int8_pack_into_int32_roundtrip(n):
    codes = tf.constant(np.random.default_rng(n).integers(-127, 128, n).astype(np.int8))
    words = codecs.pack_int8(codes)
    assert words.dtype == tf.int32 and words.shape == [(n + 3) // 4]
    np.testing.assert_array_equal(codecs.unpack_int8(words, n), codes)
    # Gathered words of several replicas unpack row by row.
    rows = codecs.unpack_int8(tf.stack([words, words]), n)
    np.testing.assert_array_equal(rows[1], codes)


def test_topk_keeps_largest_and_roundtrips():
    x = _rand(1000)
    values, indices = codecs.topk(x, 10)
    dense = codecs.densify(values, indices, 1000)
    top = np.argsort(-np.abs(x.numpy()))[:10]
    np.testing.assert_array_equal(np.sort(indices.numpy()), np.sort(top))
    np.testing.assert_array_equal(dense.numpy()[top], x.numpy()[top])
    assert np.count_nonzero(dense) == 10


def test_topk_sampled_equals_exact_topk():
    x = _rand(300_000, seed=3)
    values, indices = codecs.topk_sampled(x, 3000, tf.constant([5, 7]))
    exact_values, exact_indices = codecs.topk(x, 3000)
    np.testing.assert_array_equal(np.sort(indices.numpy()), np.sort(exact_indices.numpy()))
    np.testing.assert_array_equal(np.sort(values.numpy()), np.sort(exact_values.numpy()))


def test_topk_sampled_short_of_candidates_pads_harmlessly():
    """Too few candidates (forced by margin < 1): the message is padded with zeros that
    densify to nothing, every real entry is among the true top k, and the rest stays owed."""
    x = _rand(300_000, seed=4)
    values, indices = codecs.topk_sampled(x, 3000, tf.constant([1, 2]), margin=0.6)
    assert values.shape == [3000] and indices.shape == [3000]
    real = values.numpy() != 0
    assert 1000 < real.sum() < 3000
    kth = np.sort(np.abs(x.numpy()))[-3000]
    assert np.all(np.abs(values.numpy()[real]) >= kth)
    dense = codecs.densify(values, indices, 300_000).numpy()
    np.testing.assert_array_equal(dense[indices.numpy()[real]], x.numpy()[indices.numpy()[real]])
    assert np.count_nonzero(dense) == real.sum()


def test_topk_sampled_with_a_tensor_k_equals_exact_topk():
    """Top-k's warm-up changes k from step to step inside one traced step."""
    x = _rand(300_000, seed=5)
    sampled = tf.function(lambda k: codecs.topk_sampled(x, k, tf.constant([3, 4])))
    for k in (75_000, 3000):
        values, indices = sampled(tf.constant(k))
        _, exact_indices = codecs.topk(x, k)
        assert values.shape == [k]
        np.testing.assert_array_equal(np.sort(indices.numpy()), np.sort(exact_indices.numpy()))
    assert sampled.experimental_get_tracing_count() == 1


def test_topk_warmup_density_decays_exponentially_to_the_ratio():
    d = [sparse.warmup_density(s, 0.01, 10) for s in range(12)]
    assert d[0] == 0.25 and d[10] == d[11] == 0.01
    np.testing.assert_allclose(d[5], 0.05)  # geometric mean of 25 % and 1 %
    np.testing.assert_allclose([b / a for a, b in zip(d[:10], d[1:10])], 0.04 ** 0.1)
    assert sparse.warmup_density(0, 0.01, 0) == 0.01  # off
    assert sparse.warmup_density(0, 0.5, 10) == 0.5  # the target is already denser
    agg = TopKAggregator(0.01, warmup_steps=10, dense_below=0)
    assert [agg.k(1000, s) for s in (0, 5, 10, 1000)] == [250, 50, 10, 10]
    assert agg.k(1000) == 10 and agg.k(3, 0) == 1


@pytest.mark.parametrize("kwargs,match", [({"warmup_steps": -1}, "warmup_steps=-1"),
                                          ({"warmup_steps": 2.5}, "warmup_steps=2.5"),
                                          ({"warmup_start": 0.0}, "warmup_start=0.0")])
def test_topk_warmup_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKAggregator(0.01, **kwargs)


def test_topk_warmup_from_the_config():
    with pytest.raises(ConfigError, match="topk_warmup_steps"):
        ParallelConfig(compression="topk", topk_warmup_steps=-3)
    agg = make_aggregator(ParallelConfig(compression="topk", topk_warmup_steps=7))
    assert agg.warmup_steps == 7 and agg.get_config()["warmup_steps"] == 7


def test_adam_warmup_from_the_config():
    with pytest.raises(ConfigError, match="adam_warmup_steps=-1"):
        ParallelConfig(compression="powersgd", adam_warmup_steps=-1)
    config = ParallelConfig(compression="powersgd", optimizer="adam", adam_warmup_steps=7)
    agg = make_aggregator(config)
    assert agg.adam_warmup_steps == 7
    # The quality suite's defaults: rank 16, each replica's own `v` (README).
    assert (agg.rank, agg.adam_variance) == (16, "local_debiased")
    assert PowerSGDAggregator(**agg.get_config()).adam_variance == "local_debiased"
    assert make_aggregator(config.replace(optimizer="sgd")).adam is None
    # The trainer's warm-up and the class's are one default; after it top-k at its default
    # 25 % moves each replica's own `v` (the frozen `v` failed the user task: README).
    topk = make_aggregator(ParallelConfig(compression="topk", optimizer="adam"))
    assert topk.adam_warmup_steps == TopKAggregator(0.1, adam=(0.9, 0.999, 1e-7)).adam_warmup_steps
    assert topk.adam_variance == "local_debiased"


def test_threshold_and_sparse_packing():
    x = tf.constant([0.5, -2.0, 0.01, 3.0, -0.001])
    values, indices = codecs.threshold(x, 0.4)
    np.testing.assert_array_equal(indices, [0, 1, 3])
    v2, i2 = codecs.unpack_sparse(codecs.pack_sparse(values, indices))
    np.testing.assert_array_equal(v2, values)
    np.testing.assert_array_equal(i2, indices)
    np.testing.assert_allclose(codecs.densify(v2, i2, 5), [0.5, -2.0, 0, 3.0, 0])


@pytest.mark.parametrize("roundtrip", [
    lambda x: codecs.densify(*codecs.topk(x, 5), 500),
    lambda x: codecs.densify(*codecs.threshold(x, 1.5), 500),
    lambda x: codecs.dequantize_int8(*codecs.quantize_int8(x)),
    lambda x: codecs.cast_roundtrip(x, tf.bfloat16),
], ids=["topk", "threshold", "int8", "bf16"])
def test_error_feedback_conserves_the_sum(roundtrip):
    """Σ transmitted + final residual == Σ gradients, over many steps."""
    grads = [_rand(500, seed=s) for s in range(30)]
    residual = tf.zeros([500])
    sent_total = tf.zeros([500])
    for g in grads:
        sent, residual = error_feedback.compress_with_feedback(g, residual, roundtrip)
        sent_total += sent
    np.testing.assert_allclose(sent_total + residual, tf.add_n(grads), atol=1e-4)
    # Without feedback the same top-k loses most of the mass.


def test_error_feedback_transmits_small_coordinates_eventually():
    """A coordinate too small for top-k on its own is sent once its residual has grown."""
    g = tf.constant([1.0, 0.1, 0.0, 0.0])
    residual, got = tf.zeros([4]), tf.zeros([4])
    for _ in range(20):
        sent, residual = error_feedback.compress_with_feedback(
            g, residual, lambda x: codecs.densify(*codecs.topk(x, 1), 4))
        got += sent
    assert got[1] > 1.0  # 20 steps × 0.1 = 2.0 owed; most of it delivered


def test_powersgd_exact_on_low_rank_input():
    a, b = _rand(64, 3, seed=1), _rand(3, 48, seed=2)
    m = tf.matmul(a, b)
    approx, q = powersgd.approximate(m, powersgd.initial_q(48, 4, seed=0))
    assert q.shape == [48, 4]
    np.testing.assert_allclose(approx, m, atol=1e-4 * float(tf.reduce_max(tf.abs(m))))


def test_powersgd_orthogonalize_and_warm_start_converges():
    p = powersgd.orthogonalize(_rand(50, 4))
    np.testing.assert_allclose(tf.matmul(p, p, transpose_a=True), np.eye(4), atol=1e-5)
    # A full-rank matrix with a dominant rank-2 part: warm-started iterations converge to it.
    u, v = _rand(80, 2, seed=3), _rand(2, 60, seed=4)
    m = 10 * tf.matmul(u, v) + 0.01 * _rand(80, 60, seed=5)
    q = powersgd.initial_q(60, 2, seed=1)
    errs = []
    for _ in range(5):
        approx, q = powersgd.approximate(m, q)
        errs.append(float(tf.norm(m - approx) / tf.norm(m)))
    assert errs[-1] < 1e-3 and errs[-1] <= errs[0]


def test_powersgd_factors_sum_over_replicas():
    """Summing P and Q over replicas reproduces the factors of the summed gradient."""
    ms = [_rand(30, 20, seed=s) for s in range(4)]
    q = powersgd.initial_q(20, 3, seed=0)
    p_hat = powersgd.orthogonalize(tf.add_n([powersgd.compress_p(m, q) for m in ms]))
    q_sum = tf.add_n([powersgd.compress_q(m, p_hat) for m in ms])
    approx_of_sum, _ = powersgd.approximate(tf.add_n(ms), q)
    np.testing.assert_allclose(powersgd.decompress(p_hat, q_sum), approx_of_sum, atol=1e-4)


@pytest.mark.parametrize("shape,rank,expected", [
    ((64,), 4, False), ((8, 8), 4, False), ((256, 256), 4, True), ((3, 3, 16, 32), 4, True),
    ((1, 1000), 4, False)])
def test_powersgd_compressible(shape, rank, expected):
    assert powersgd.compressible(shape, rank) is expected


def test_bucket_pack_unpack_roundtrip():
    tensors = [_rand(3, 4, seed=0), _rand(5, seed=1), _rand(2, 2, 2, seed=2), _rand(100, seed=3)]
    plan = buckets.plan_buckets([t.shape for t in tensors], bucket_bytes=4 * 30)
    # Filled from the last tensor: the 100-element one alone, then the rest together.
    assert [b.positions for b in plan] == [(3,), (2, 1, 0)]
    assert [b.size for b in plan] == [100, 25]
    out = {}
    for b in plan:
        flat = buckets.pack(tensors, b)
        assert flat.shape == [b.size]
        out.update(buckets.unpack(flat, b))
    for i, t in enumerate(tensors):
        np.testing.assert_array_equal(out[i], t)


def test_bucket_single_bucket_when_budget_is_large():
    plan = buckets.plan_buckets([(10,), (20, 2), ()], bucket_bytes=25 * 2 ** 20)
    assert len(plan) == 1 and plan[0].size == 51


@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000])
def test_lowbit_bits_pack_into_int32_roundtrip(n):
    bits = tf.constant(np.random.default_rng(n).integers(0, 2, n).astype(np.int32))
    words = lowbit.pack_bits(bits)
    assert words.dtype == tf.int32 and words.shape == (lowbit.words_per_plane(n),)
    assert np.array_equal(lowbit.unpack_bits(words, n).numpy(), bits.numpy())
    # Rows of gathered words unpack row by row.
    assert np.array_equal(lowbit.unpack_bits(tf.stack([words, words]), n).numpy()[1], bits)


def test_lowbit_blocks_are_cut_per_tensor():
    assert lowbit.block_ids([5, 3], 4).numpy().tolist() == [0, 0, 0, 0, 1, 2, 2, 2]
    assert lowbit.block_count([5, 3], 4) == 3


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lowbit_codes_decode_within_their_bound(bits):
    sizes = [300, 40]  # a kernel and a bias 100x smaller: each keeps its own scale
    x = tf.concat([_rand(300), _rand(40, seed=1) / 100], 0)
    ids, count = lowbit.block_ids(sizes, 64), lowbit.block_count(sizes, 64)
    words, scales = lowbit.encode(x, ids, count, bits)
    assert words.shape == (bits * lowbit.words_per_plane(340),) and scales.shape == (count,)
    y = lowbit.decode(words, scales, ids, 340, bits).numpy()
    per_entry = tf.gather(scales, ids).numpy()
    if bits == 1:  # the sign, and each block's L1 norm
        assert np.array_equal(np.sign(y), np.where(x.numpy() >= 0, 1, -1))
        l1 = tf.math.unsorted_segment_sum(tf.abs(x), ids, count).numpy()
        np.testing.assert_allclose(
            tf.math.unsorted_segment_sum(np.abs(y), ids, count).numpy(), l1, rtol=1e-5)
    else:  # to nearest: within half a step of the block's own scale
        assert np.all(np.abs(y - x.numpy()) <= per_entry / 2 * (1 + 1e-5))
        zeros = lowbit.decode(*lowbit.encode(tf.zeros(70), ids[:70], 2, bits), ids[:70], 70,
                              bits)
        assert not np.any(zeros.numpy())
    assert np.max(np.abs(y[300:])) < 0.1  # the bias did not take the kernel's scale


@pytest.mark.parametrize("bits", [1, 3])
@pytest.mark.parametrize("n", [40, 64, 150])
def test_lowbit_rows_encode_as_each_row_alone(bits, n):
    # The mesh codes each replica's row of one tensor at once (blocks by reshape: DTensor
    # has no segment reductions); each row's words and scales are its own message's.
    rows = tf.stack([_rand(n, seed=s) * (s + 1) for s in range(3)])
    ids, count = lowbit.block_ids([n], 64), lowbit.block_count([n], 64)
    words, scales = lowbit.encode(rows, ids, count, bits, block=64)
    assert words.shape == (3, bits * lowbit.words_per_plane(n)) and scales.shape == (3, count)
    for r in range(3):
        own_words, own_scales = lowbit.encode(rows[r], ids, count, bits)
        assert np.array_equal(words[r].numpy(), own_words.numpy()), r
        # 1 bit: a block's mean magnitude, summed in another order (a padded reshape).
        np.testing.assert_allclose(scales[r].numpy(), own_scales.numpy(),
                                   rtol=1e-6 if bits == 1 else 0)
    np.testing.assert_array_equal(lowbit.decode(words, scales, ids, n, bits)[2].numpy(),
                                  lowbit.decode(words[2], scales[2], ids, n, bits).numpy())


def test_lowbit_rejects_bad_settings():
    with pytest.raises(ValueError, match="block=0 is invalid"):
        lowbit.LowBitAggregator(block=0)
    with pytest.raises(ValueError, match="bits=8 is invalid"):
        lowbit.LowBitAggregator(bits=8)
    with pytest.raises(ConfigError, match="lowbit_bits"):
        ParallelConfig(compression="lowbit", lowbit_bits=5)
    agg = make_aggregator(ParallelConfig(compression="lowbit", optimizer="adam"))
    assert (agg.bits, agg.adam_variance) == (3, "local_debiased")
