"""PowerSGD's packing: every matrix's P and the uncompressed tensors in one all-reduce, every
Q in a second, whatever the number of tensors; unpacked back to the right tensors.

One replica (the default strategy): the sums are the replica's own factors, so the result
must be PowerSGD's single-replica round trip per matrix and the uncompressed tensors
unchanged, bit for bit.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfpar.compression import collectives, powersgd
from tfpar.compression.lowrank import PowerSGDAggregator

# Matrices of several shapes (a conv kernel and a 3-D kernel among them), vectors, a scalar
# and a matrix too small to compress (its factors would be larger than itself); two of the
# same shape (their P's are orthogonalised in one batched QR).
SHAPES = [(24, 16), (16,), (3, 3, 4, 8), (8,), (8, 6, 5), (2, 3), (), (40, 40), (40,),
          (24, 16)]
RANK = 2


@pytest.fixture(scope="module")
def run():
    rng = np.random.RandomState(0)
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    grads = [tf.constant(np.asarray(rng.randn(*s), "float32")) for s in SHAPES]
    agg = PowerSGDAggregator(rank=RANK, error_feedback=False)
    agg.build(variables)
    q0 = {k: tf.identity(v) for k, v in agg.qs.items()}
    calls = []
    real = collectives.sum_all

    def recording(flat, opts):
        calls.append(int(flat.shape[0]))
        return real(flat, opts)

    collectives.sum_all = recording
    try:
        out = tf.function(lambda g: agg.all_reduce_sum(g, variables))(grads)
    finally:
        collectives.sum_all = real
    return {"agg": agg, "grads": grads, "out": out, "calls": calls, "q0": q0}


def test_two_all_reduces_sized_p_plus_uncompressed_then_q(run):
    matrices = run["agg"]._matrices()
    assert matrices == [0, 2, 4, 7, 9]  # (2, 3) is not worth compressing
    n_p = n_q = 0
    for i in matrices:
        n, m = powersgd.matrix_shape(SHAPES[i])
        r = powersgd.effective_rank(SHAPES[i], RANK)
        n_p, n_q = n_p + n * r, n_q + m * r
    rest = sum(int(np.prod(s)) for i, s in enumerate(SHAPES) if i not in matrices)
    assert run["calls"] == [n_p + rest, n_q]
    assert run["agg"].comm_stats()["bytes_on_wire_per_step"] == 4 * (n_p + rest + n_q)


def test_unpacked_into_the_right_tensors(run):
    matrices = run["agg"]._matrices()
    for i, (g, out) in enumerate(zip(run["grads"], run["out"])):
        assert tuple(out.shape) == SHAPES[i]
        if i not in matrices:  # sent uncompressed: unchanged
            np.testing.assert_array_equal(out.numpy(), g.numpy())
            continue
        m = tf.reshape(g, powersgd.matrix_shape(SHAPES[i]))
        approx, new_q = powersgd.approximate(m, run["q0"][str(i)])
        np.testing.assert_allclose(out.numpy(), tf.reshape(approx, SHAPES[i]).numpy(),
                                   rtol=1e-5, atol=1e-5)
        # The warm start for the next step is the summed (here: own) Q.
        np.testing.assert_allclose(run["agg"].qs[str(i)].numpy(), new_q.numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_compress_q_is_m_transposed_p():
    rng = np.random.RandomState(1)
    m = rng.randn(50, 30).astype("float32")
    p_hat = powersgd.orthogonalize(tf.constant(rng.randn(50, 4).astype("float32")))
    np.testing.assert_allclose(powersgd.compress_q(tf.constant(m), p_hat).numpy(),
                               m.T @ p_hat.numpy(), rtol=1e-5, atol=1e-5)


def _two_steps(groups):
    """Two steps of `groups` groups on the same gradients (error feedback on): the outputs,
    each matrix's Q and residual after them, and the all-reduces' lengths."""
    rng = np.random.RandomState(0)
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    grads = [tf.constant(np.asarray(rng.randn(*s), "float32")) for s in SHAPES]
    agg = PowerSGDAggregator(rank=RANK, groups=groups)
    agg.build(variables)
    calls = []
    real = collectives.sum_all

    def recording(flat, opts):
        calls.append(int(flat.shape[0]))
        return real(flat, opts)

    collectives.sum_all = recording
    try:
        step = tf.function(lambda g: agg.all_reduce_sum(g, variables))
        out = step(grads) + step(grads)
    finally:
        collectives.sum_all = real
    state = [agg.qs[k] for k in sorted(agg.qs)] + [agg.residuals[k] for k in sorted(agg.residuals)]
    return [t.numpy() for t in out + state], calls


def test_groups_send_the_same_sums_in_more_rounds():
    one, one_calls = _two_steps(1)
    two, two_calls = _two_steps(2)
    # Last layers first: the (40, 40) and the last (24, 16) with the (40,) between them,
    # then the rest, each group a P round (with its uncompressed tensors) and a Q round.
    assert len(two_calls) == 4 and two_calls[0] == 40 * RANK + 24 * RANK + 40
    assert sum(two_calls) == sum(one_calls) and len(one_calls) == 2
    # One replica: the sums are its own factors, so grouping may change nothing.
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def test_groups_refused_below_one():
    with pytest.raises(ValueError, match=r"groups=0 is invalid: must be an integer >= 1"):
        PowerSGDAggregator(groups=0)


def _sums_and_hint(grads, in_function=True):
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    agg = PowerSGDAggregator(rank=RANK)
    agg.build(variables)

    def step(g):
        return agg.all_reduce_sum(g, variables), agg.certainly_finite()

    out, hint = (tf.function(step) if in_function else step)(grads)
    return [o.numpy() for o in out], bool(hint.numpy())


def _grads(scale=1.0):
    rng = np.random.RandomState(3)
    return [np.asarray(scale * rng.randn(*s), "float32") for s in SHAPES]


@pytest.mark.parametrize("scale", [1.0, 1e18, 1e30, 1e36, 1e37, 3e37, 1e38])
def test_the_factors_vouch_only_for_finite_sums(scale):
    # The guard skips its pass over the sums when the factors say finite: they must never
    # say so of a sum that is not (at these scales `M Q` or the decode overflows).
    out, hint = _sums_and_hint([tf.constant(g) for g in _grads(scale)])
    assert not hint or all(np.isfinite(o).all() for o in out), scale
    if scale == 1.0:
        assert hint  # an ordinary step needs no pass over the sums


@pytest.mark.parametrize("where", [0, 1, 6, 7])  # a matrix, a bias, the scalar, (40, 40)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_gradient_anywhere_fails_the_factors_check(where, value):
    grads = _grads()
    grads[where].reshape(-1)[0] = value
    out, hint = _sums_and_hint([tf.constant(g) for g in grads])
    assert not hint
    assert not all(np.isfinite(o).all() for o in out)  # (what the guard's pass then finds)


def test_the_hint_is_of_the_call_just_made():
    # Eagerly too; a hint traced in another graph is never handed out.
    _, hint = _sums_and_hint([tf.constant(g) for g in _grads()], in_function=False)
    assert hint
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    agg = PowerSGDAggregator(rank=RANK)
    agg.build(variables)
    tf.function(lambda g: agg.all_reduce_sum(g, variables))(
        [tf.constant(g) for g in _grads()])
    assert agg.certainly_finite() is None  # eager now: the traced graph's tensor is not


def test_the_decode_bound_refuses_finite_factors_whose_decode_overflows():
    # The one case the bound `2·rank·max|P̂|·max|Q|` is there for: M, P, P̂ and Q all
    # finite, `P̂ Qᵀ` not (a column of M outside the warm-start Q's span, cancelled in P's
    # row 0 but not in Q). Without the bound the factors would vouch for it (a review's
    # construction; the scaled gradients above overflow earlier, in QR).
    from tfpar.compression import lowrank, powersgd

    rng = np.random.RandomState(0)
    n, m, r = 16, 16, 4
    for _ in range(300):
        a_ = rng.randn(n, r)
        a_[0] = 3.0 + 0.1 * rng.randn(r)
        basis, _ = np.linalg.qr(a_)
        w = basis[0] / np.linalg.norm(basis[0])
        for a in (1.5e38, 2e38, 2.5e38, 3e38):
            proj = basis @ (a * w / np.abs(w).max())
            e0 = np.eye(n)[0]
            perp = e0 - basis @ (basis.T @ e0)
            if abs(perp[0]) < 1e-6:
                continue
            col = proj - (proj[0] / perp[0]) * perp * 0.999
            if not np.all(np.abs(col) < 3.3e38):
                continue
            matrix = np.zeros((n, m))
            matrix[:, 0], matrix[:, 1:1 + r] = col, basis
            q0 = np.zeros((m, r))
            q0[1:1 + r] = np.eye(r)
            m32, q32 = tf.constant(matrix, tf.float32), tf.constant(q0, tf.float32)
            p = powersgd.compress_p(m32, q32)
            p_hat = powersgd.orthogonalize(p)
            q = powersgd.compress_q(m32, p_hat)
            finite = [bool(np.isfinite(t.numpy()).all()) for t in (m32, p, p_hat, q)]
            if all(finite) and not np.isfinite(powersgd.decompress(p_hat, q).numpy()).all():
                small = [lowrank._Small(tf.reshape(p, [-1]), [p_hat], tf.reshape(q, [-1]))]
                assert not bool(lowrank._certainly_finite(small, r).numpy())
                return
    pytest.fail("no finite-factor, overflowing-decode case constructed")
