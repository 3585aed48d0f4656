"""`--compression=auto` and Adam's step compressed, on two workers
(MultiWorkerMirroredStrategy on localhost, each its own process and data): the workers make
every rank decision alike and end bit-identical; with Adam moved in front of compression
and nothing dropped, the run equals Keras's own Adam (in the exact warm-up, and with the
second moment frozen after it). The workers' code: tests/auto_workers_child.py."""

import os

from subproc import ROOT
from test_compression_multiworker import _run_workers

WORKER = os.path.join(ROOT, "tests", "auto_workers_child.py")


def test_auto_workers_agree_and_adam_step_matches_keras(report_measured):
    a, b = _run_workers(WORKER, timeout=240)
    report_measured(f"auto's link measurement, 2 localhost workers: {a['link'][0] / 1e9:.2f} "
                    f"GB/s, {a['link'][1] * 1e3:.1f} ms latency, in {a['link_s']:.2f} s")
    for key in ("hash", "losses", "wire", "ranks", "plan", "layers"):
        assert a["auto"][key] == b["auto"][key], f"auto: workers differ in {key}"
    assert a["auto"]["residual"] != b["auto"]["residual"]  # each keeps its own error
    assert a["planned"] == b["planned"], "auto: the workers planned different first ranks"
    assert a["planned"]["ranks"][0] != a["planned"]["ranks"][4], a["planned"]["ranks"]
    assert a["link"] == b["link"], "the workers measured different links"
    bytes_per_s, latency = a["link"]
    assert 1e5 < bytes_per_s < 1e12 and 0 < latency < 1, a["link"]
    wire, ranks = a["auto"]["wire"], a["auto"]["ranks"]
    assert a["auto"]["plan"] == 4 and a["auto"]["r_max"] == [[0, 8], [2, 16]], a["auto"]
    assert a["auto"]["raised"] is True
    # Bytes of a compressed step: both matrices' factors (16x64 and 64x64), the four vectors
    # and the 64x1 kernel in fp32, and 1 + largest-rank floats a matrix for the errors.
    def factored(r0, r2):
        return 4 * (80 * r0 + 128 * r2) + 4 * (64 + 64 + 64 + 1) + 4 * (9 + 17)
    # Steps 0-1 exact; 2 at the budget's rank; from step 3 the guard's raised floor (8, 8);
    # window ends at steps 4, 7, 10 double the ranks up to 8 and 16.
    assert wire[0] == wire[1] == 4 * (16 * 64 + 64 + 64 * 64 + 64 + 64 + 1), wire
    assert wire[2] == factored(4, 4), wire
    assert wire[3] == wire[4] == factored(8, 8), wire
    assert wire[5] == factored(8, 16) and wire[-1] == factored(8, 16), wire
    assert ranks[-1] == [["0", 8], ["2", 16]], ranks[-1]
    # Each worker's own share held back (summed over both) and the summed gradient's share
    # in the top half of the columns: none before the first window ends, then in (0, 1),
    # the same on both workers.
    assert a["auto"]["errors"][3] == [[0, None, None], [2, None, None]], a["auto"]["errors"]
    for row in a["auto"]["errors"][4:]:
        assert all(0 < e < 1 and 0 < top < 1 for _, e, top in row), row
    assert a["auto"]["errors"] == b["auto"]["errors"]
    layers = a["auto"]["layers"]
    assert layers["2"]["sends"] == "rank 16" and layers["1"]["sends"] == "fp32", layers
    assert sum(wire) / len(wire) == a["auto"]["mean_bytes"], (wire, a["auto"]["mean_bytes"])
    assert a["auto"]["losses"][-1] < 0.5 * a["auto"]["losses"][0], a["auto"]["losses"]
    assert a["adam_step_max_diff"] < 1e-6, a["adam_step_max_diff"]
    # Share of Keras Adam's distance each weight moved in 300 steps of a constant gradient:
    # ~1 for Keras, far less with top-k 1 % on gradients, and at least 2/3 (error feedback
    # holds back at most ~100 steps of it) with Adam's step compressed.
    moved = a["moved"]
    assert abs(moved["keras"] - 1) < 0.01, moved
    assert moved["topk_gradient"] < 0.4 and moved["topk_adam_step"] > 0.6, moved
    frozen = a["frozen"]
    assert frozen["step"] == 40, frozen  # 5 exact steps, then 35 with v frozen
    assert abs(frozen["topk"] / frozen["keras"] - 1) < 1e-5, frozen


def test_auto_error_is_the_share_held_back_and_ranks_follow_the_spectrum():
    """One replica, no strategy, window 1: the error auto reports is `||M − P̂ P̂ᵀ M|| / ||M||`
    of the matrix it compressed (the first step's gradient, rank 1 from the seeded Q); the
    rank doubles while the top half of the columns carries >= up_share of what is sent
    (singular values 3 and 2: the second column carries 4/13), and drops back once the
    columns beyond rank 2 carry only the noise."""
    import numpy as np
    import tensorflow as tf

    from tfpar.compression import AutoAggregator, powersgd

    rng = np.random.RandomState(0)
    u, _ = np.linalg.qr(rng.randn(64, 2))
    v_, _ = np.linalg.qr(rng.randn(32, 2))
    g = (u @ np.diag([3.0, 2.0]) @ v_.T + 1e-3 * rng.randn(64, 32)).astype("float32")
    v = tf.Variable(tf.zeros([64, 32]))
    agg = AutoAggregator(budget_ms=1.0, link=(1e3, 0.0), window=1, eta=10.0, start_step=0,
                         start_rank=1)
    agg.build([v])
    assert agg.r_budget == 1 and agg.r_max == {0: 16}  # 1 byte of budget: rank 1
    agg.all_reduce_sum([tf.constant(g)], [v])
    q = powersgd.initial_q(32, 16, 0).numpy()[:, :1]
    p = g @ q
    p /= np.linalg.norm(p)
    expected = np.linalg.norm(g - p @ (p.T @ g)) / np.linalg.norm(g)
    error = agg.error_of(0)
    assert 0.1 < expected < 0.9 and abs(error - expected) < 1e-4 * expected, (error, expected)
    ranks = [agg.rank_of(0)]  # at rank 1 the top half is the whole message: doubles
    for _ in range(2):
        agg.all_reduce_sum([tf.constant(g)], [v])
        ranks.append(agg.rank_of(0))
    assert ranks == [2, 4, 2], ranks
    assert agg.top_share_of(0) < 0.01, agg.top_share_of(0)  # columns 3-4 at rank 4: noise
    agg.all_reduce_sum([tf.constant(g)], [v])
    assert int(agg.wire_bytes.numpy()) == 4 * (64 + 32) * 2 + 4 * 17  # rank-2 factors, errors


def _planted(singular_values, shape=(64, 32), noise=1e-3, seed=0):
    import numpy as np
    rng = np.random.RandomState(seed)
    r = len(singular_values)
    u, _ = np.linalg.qr(rng.randn(shape[0], r))
    v_, _ = np.linalg.qr(rng.randn(shape[1], r))
    return (u @ np.diag(singular_values) @ v_.T + noise * rng.randn(*shape)).astype("float32")


def _start(agg, g, steps):
    """`steps` more steps of auto on the constant gradient `g` (one replica, no strategy;
    the same variable each call): the bytes of each step."""
    import tensorflow as tf
    if not agg.built:
        agg.test_variable = tf.Variable(tf.zeros(g.shape))
        agg.build([agg.test_variable])
    v = agg.test_variable
    wire = []
    for _ in range(steps):
        agg.all_reduce_sum([tf.constant(g)], [v])
        wire.append(int(agg.wire_bytes.numpy()))
    return wire


def test_auto_plans_its_first_rank_from_the_exact_start_without_bytes():
    """The exact start's last `window` steps run PowerSGD's subspace iteration on the exact
    sum: the first compressed rank is the spectrum's (singular values 3 and 2 plus noise:
    rank 2 holds all but the noise, rank 1 leaves 4/13), and Q starts warm (the first
    compressed step holds back less than twice the noise's share, where the seeded random Q
    at the same rank held back more). The exact steps send what they sent before. With
    Adam in front the plan is of what compression will carry, the gradient over Adam's
    denominator (≈ its sign for a constant gradient: full rank), not of the gradient."""
    import numpy as np
    from tfpar.compression import AutoAggregator

    g = _planted([3.0, 2.0])
    kwargs = dict(budget_ms=1.0, link=(1e3, 0.0), window=2, eta=10.0, start_step=3)
    planned = AutoAggregator(**kwargs)
    wire = _start(planned, g, 4)
    assert wire[:3] == [4 * 64 * 32] * 3, wire  # exact: fp32, nothing added
    assert planned.rank_of(0) == 2 and wire[3] == 4 * (64 + 32) * 2 + 4 * 17, (
        planned.rank_of(0), wire)
    cold = AutoAggregator(start_rank=2, **kwargs)  # the same rank from the seeded Q
    _start(cold, g, 4)
    assert cold.rank_of(0) == 2
    # The share each replica held back on the first compressed step (recorded at the
    # first window's end: window 2, so after steps 3 and 4).
    for agg in (planned, cold):
        _start(agg, g, 1)
    warm_error, cold_error = planned.error_of(0), cold.error_of(0)
    noise_share = 1e-3 * np.sqrt(64 * 32) / np.linalg.norm(g)
    assert warm_error < 2 * noise_share < cold_error, (warm_error, cold_error, noise_share)
    largest = AutoAggregator(start_rank=64, **kwargs)  # the old start: each layer's largest
    _start(largest, g, 4)
    assert largest.rank_of(0) == 16

    adam = AutoAggregator(adam=(0.9, 0.999, 1e-7), adam_warmup_steps=3,
                          adam_variance="local_debiased", **{**kwargs, "start_step": 0})
    _start(adam, g, 3)
    assert adam.rank_of(0) >= 8, adam.rank_of(0)  # sign(g) is not of rank 2


def test_bad_auto_settings_are_refused_in_one_line():
    import pytest
    from tfpar.compression import AutoAggregator
    for kwargs, match in (({"up_share": 0.1, "down_share": 0.5}, "up_share=0.1, down_share=0.5"),
                          ({"up_share": 1.5}, "up_share=1.5"),
                          ({"down_share": -0.1}, "down_share=-0.1"),
                          ({"start_rank": 0}, "start_rank=0 is invalid"),
                          ({"start_rank": True}, "start_rank=True is invalid"),
                          ({"window": 0}, "window=0 is invalid")):
        with pytest.raises(ValueError, match=match):
            AutoAggregator(link=(12.5e6, 1e-3), **kwargs)
    assert AutoAggregator(link=(12.5e6, 1e-3), start_rank=4).start_rank == 4


def test_link_measurement_grows_the_message_until_noise_cannot_hide_the_bandwidth(monkeypatch):
    """A 10 GB/s link with 1 ms latency, timed with 0.2 ms of noise against the large message
    (as on a loaded machine): 1 MB then goes no slower than 1 kB, so those two sizes alone
    give no bandwidth; the measurement grows the large message until they do."""
    import pytest
    from tfpar.compression import auto
    link_bytes_per_s, latency, noise = 1e10, 1e-3, 2e-4
    asked = []

    def timed(strategy, small, large, repeats):
        asked.append(large)
        return latency + 4 * small / link_bytes_per_s, latency + 4 * large / link_bytes_per_s - noise

    monkeypatch.setattr(auto, "_agreed_times", timed)
    bytes_per_s, measured_latency = auto.measure_link(None)
    assert asked == [262144, 1 << 20, 1 << 22], asked
    assert abs(bytes_per_s / link_bytes_per_s - 1) < 0.15, bytes_per_s
    assert abs(measured_latency / latency - 1) < 0.01, measured_latency
    # A link too fast for the largest message stops at the cap and says so.
    asked.clear()
    monkeypatch.setattr(auto, "_agreed_times", lambda s, small, large, r: asked.append(large) or (1e-3, 1e-3))
    assert auto.measure_link(None, max_floats=1 << 22) == pytest.approx((1e12, 1e-3), rel=1e-5)
    assert asked == [262144, 1 << 20, 1 << 22], asked


def test_auto_without_error_feedback_applies_the_projection_it_sent():
    """One replica, no strategy, `error_feedback=False`: no residuals, and each step applies
    `P̂ P̂ᵀ M` of the gradient it is given (P̂ = orth(M Q), the rank-2 Q from the seed on the
    first step, the summed Q after), as with error feedback on its first step; nothing is
    carried to the next step."""
    import numpy as np
    import tensorflow as tf

    from tfpar.compression import AutoAggregator, powersgd

    g = _planted([3.0, 2.0, 1.0])
    outs = {}
    for feedback in (False, True):
        agg = AutoAggregator(budget_ms=1.0, link=(1e3, 0.0), window=100, start_step=0,
                             start_rank=2, error_feedback=feedback)
        v = tf.Variable(tf.zeros(g.shape))
        agg.build([v])
        outs[feedback] = [agg.all_reduce_sum([tf.constant(g)], [v])[0].numpy()
                          for _ in range(2)]
        assert bool(agg.residuals) is feedback
    q = powersgd.initial_q(32, 16, 0).numpy()[:, :2]
    for step in range(2):
        p, _ = np.linalg.qr(g @ q)
        expected = p @ (p.T @ g)
        np.testing.assert_allclose(outs[False][step], expected, rtol=1e-4, atol=1e-5)
        q = g.T @ p  # the warm start: this step's summed Q
    np.testing.assert_allclose(outs[True][0], outs[False][0], rtol=1e-5, atol=1e-6)
    # With error feedback the second step also sends what the first held back.
    assert np.abs(outs[True][1] - outs[False][1]).max() > 1e-3
