"""Aggregators with Adam in front, on two replicas that see different gradients (one child,
`tests/adam_front_child.py`, imports TensorFlow once and runs the three probes on one
`MirroredStrategy`).

Top-k (frozen `v`): at ratio >= 1 − β₁, after each compressed step every replica's momentum
is the momentum the summed step applied (DeepSpeed 1-bit Adam's synced momentum). Without it
each replica kept the momentum of its own gradient, which went on pushing the entries still
waiting in its residual: top-k 10 % ended the convnet 4.3× above fp32's loss
(docs/compression.md). The checks: the replicas' momenta are equal and are the step the
weights last moved by (× c1 · s); at ratio 1 (nothing dropped) the weights still equal
frozen-`v` Adam through the exact aggregator; the momentum carry; the union of indices.

PowerSGD with `v` not frozen (`Aggregator.set_adam_variance`):

- `adam_variance="live"`: `v` takes the square of the summed gradient compression delivered,
  every step. With nothing lost (every gradient is zero outside two rows, so rank 2 is
  exact, also after Adam's elementwise scaling) that is Adam on the summed gradient: `v` and
  the weights equal a NumPy Adam's; the frozen `v` (the default) does not.
- `adam_refresh_every=K` (0/1 Adam's exact variance steps): at rank 1 (lossy, residuals
  held), the refresh step's `v` is `β₂ᴷ v + (1 − β₂ᴷ) g²` of the exact summed gradient, `v`
  stays put between refreshes, and each replica's residual (held as gradient / Adam's
  denominator) is rescaled so the gradient still owed is unchanged.
- `adam_variance="local"` / `"local_debiased"`: each replica moves its own `v` with its own
  exact gradient and sends its gradient over its own denominator; the momentum is of the
  summed scaled gradients. With nothing lost and different gradients per replica: the
  weights equal a NumPy model of the method and are the same on both replicas, the
  momentum too, while the replicas' `v` differ; with one gradient for both (of constant
  magnitude, so Adam's denominator stays put) it is Adam.
"""

import os
import sys

import pytest

from subproc import ROOT, last_json_line, run

CHILD = os.path.join(ROOT, "tests", "adam_front_child.py")


@pytest.fixture(scope="module")
def probes():
    return last_json_line(run([sys.executable, CHILD], timeout=300).stdout)


def test_topk_adam_momentum_is_synced_and_exact_when_nothing_dropped(probes):
    out = probes["topk_momentum"]
    # Compression ran and dropped entries on the last step (each replica sends 40 of 200).
    assert 0 < out["sent_share"] < 0.5, out
    # One momentum on every replica (before: each replica's own, ~the noise apart) ...
    assert out["m_replicas_diff"] == 0.0, out
    # ... and it is what was applied: zero where nothing was sent.
    assert out["m_where_unsent"] == 0.0, out
    assert out["m_vs_applied"] < 1e-4 * out["m_scale"], out
    # Nothing dropped: still frozen-v Adam on the summed gradient.
    assert out["moved"] > 0.05, out
    assert out["full_vs_exact"] < 1e-6, out
    # The momentum carry keeps it exact when nothing is dropped ...
    assert out["carry_full_vs_exact"] < 1e-6, out
    # ... and where no replica sent an entry it still moves, by α · β₁ · m / (c1 · s) (with
    # carry 0 it stays put: m_where_unsent above); the momentum is still what was applied.
    assert 0.3 < out["carry_unsent_share"] < 1, out
    assert out["carry_unsent_scale"] > 0.01, out
    assert out["carry_unsent_err"] < 1e-4 * out["carry_unsent_scale"], out
    assert out["carry_m_vs_applied"] < 1e-4 * out["carry_m_scale"], out


def test_topk_syncs_momentum_only_when_entries_wait_less_than_its_time_constant():
    from tfpar.compression import TopKAggregator
    assert not TopKAggregator(1.0).adam_sync_momentum  # no Adam in front
    for ratio, synced in ((0.01, False), (0.05, False), (0.1, True), (0.3, True)):
        agg = TopKAggregator(ratio)
        agg.adam = (0.9, 0.999, 1e-7)
        assert agg.adam_sync_momentum is synced, ratio


def test_topk_union_sends_the_same_entries_everywhere_and_small_tensors_whole(probes):
    out = probes["topk_union"]
    k = 20  # 5 % of 400
    for row in out["union"]:
        assert row["same_out"], row
        # dense_below=8: the (8,) tensor is exact and leaves nothing behind.
        assert row["small_err"] < 1e-5 and row["small_residual"] == 0.0, row
        assert row["conserved"] < 1e-5, row
        # Every replica empties its residual at the same entries (the union of both top-k's),
        # and there the sum is exact: the replicas' noise cancels as uncompressed.
        assert row["emptied_same"] and k <= row["sent"] <= 2 * k, row
        assert row["sent_err"] < 1e-5, row
    # Without the union each replica empties its own top-k (the check above can fail) and
    # a small tensor sends one entry.
    assert not all(row["emptied_same"] for row in out["own"]), out["own"]
    assert all(row["small_residual"] > 0 for row in out["own"]), out["own"]


def test_topk_sends_small_tensors_as_values_only(probes):
    out = probes["topk_union"]
    k, replicas, small = 20, 2, 8
    # Bytes handed to the collectives, per replica: the (8,) tensor's 8 values, no indices
    # (12 B per entry through the sparse path at 2 replicas with the union, 8 B without).
    expected = {"union": 4 * k + 4 * k * replicas + 4 * small,
                "union_alone": 4 * k + 4 * k * replicas + 4 * small,
                "own_whole": 8 * k + 4 * small, "own_whole_alone": 8 * k + 4 * small,
                "own": 8 * (k + 1)}
    for name, nbytes in expected.items():
        for row in out[name]:
            assert row["bytes"] == row["expected_bytes"] == nbytes, (name, row)
    for name in ("union_alone", "own_whole", "own_whole_alone"):
        for row in out[name]:
            assert row["same_out"] and row["conserved"] < 1e-5, (name, row)
            assert row["small_err"] < 1e-5 and row["small_residual"] == 0.0, (name, row)
    # The same entries sent whether or not the small tensor shares the large one's bucket.
    assert [r["sent"] for r in out["union"]] == [r["sent"] for r in out["union_alone"]]


def test_topk_never_sends_a_tensor_in_more_bytes_than_fp32(probes):
    out = probes["topk_union"]
    large, small = 400, 8
    k = 160  # 40 % of the large tensor
    # With the union a sparse message would be 4k + 4k·replicas = 1920 B > 1600 B of values
    # (the small tensor's 48 B > 32 B): both go whole, summed exactly, nothing held back.
    for row in out["union_dense"]:
        assert row["bytes"] == row["expected_bytes"] == 4 * (large + small), row
        assert row["same_out"] and row["conserved"] < 1e-5 and row["sent_err"] < 1e-5, row
        assert row["sent"] == large and row["small_residual"] == 0.0, row
    # Each replica's own pairs (8k = 1280 B) stay below fp32's: the large tensor stays sparse.
    for row in out["own_dense"]:
        assert row["bytes"] == row["expected_bytes"] == 8 * k + 4 * small, row
        assert row["sent"] < large, row


def test_topk_defaults_are_the_suites_and_bad_settings_are_refused():
    import pytest
    from tfpar import ParallelConfig
    from tfpar.compression import TopKAggregator, make_aggregator
    from tfpar.errors import ConfigError
    agg = make_aggregator(ParallelConfig(compression="topk", optimizer="adam"))
    assert (agg.ratio, agg.union, agg.dense_below, agg.adam_momentum_carry,
            agg.adam_variance) == (0.25, True, 1024, 0.5, "local_debiased")
    assert agg.adam_sync_momentum and TopKAggregator(**agg.get_config()).union
    assert agg.k(1024) == 1024 and agg.k(1025) == 257
    # Below 1 − β₁ the momentum is not synced, so each replica's own `v` cannot be used.
    sparse = make_aggregator(ParallelConfig(compression="topk", optimizer="adam",
                                            topk_ratio=0.05))
    assert not sparse.adam_sync_momentum and sparse.adam_variance == "frozen"
    # Your own Adam's β₁ is copied in: at β₁ = 0.5 the momentum syncs only from 50 %, so
    # each replica's own `v` at 25 % is refused in one line naming it.
    import keras
    from tfpar.compression import wrap_optimizer
    with pytest.raises(ValueError, match="adam_variance='local_debiased' is invalid"):
        wrap_optimizer(keras.optimizers.Adam(1e-3, beta_1=0.5), make_aggregator(
            ParallelConfig(compression="topk", optimizer="adam")))
    assert wrap_optimizer(keras.optimizers.Adam(1e-3, beta_1=0.8), make_aggregator(
        ParallelConfig(compression="topk", optimizer="adam"))).tfpar_aggregator.adam[0] == 0.8
    with pytest.raises(ConfigError, match="topk_dense_below"):
        ParallelConfig(compression="topk", topk_dense_below=-1)
    with pytest.raises(ConfigError, match="topk_momentum_carry"):
        ParallelConfig(compression="topk", topk_momentum_carry=1.5)
    for kwargs in ({"dense_below": -1}, {"dense_below": 1.5}, {"adam_momentum_carry": 2.0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            TopKAggregator(0.1, **kwargs)


def test_live_and_refreshed_adam_variance(probes):
    out = probes["powersgd_variance"]
    assert out["moved"] > 0.05, out
    # Live v with nothing lost is Adam on the summed gradient; the frozen v is not.
    assert out["live_v"] < 1e-5, out
    assert out["live_w"] < 1e-4 * out["moved"], out  # float32 rounding of the sums
    assert out["frozen_w"] > 1e-3 * out["moved"], out
    # Frozen between refreshes; the refresh takes the exact summed gradient, weighted as
    # the EVERY steps since v last moved.
    assert out["frozen_between"] == 0.0, out
    assert out["refresh_v_moved"] > 1e-3, out
    assert out["refresh_v"] < 1e-4, out  # float32: 1 − β₂ᴷ is ~4e-3
    # Residuals were held (rank 1 of rank-2 gradients) and rescaled with the denominator.
    assert out["residual_held"] > 1e-3, out
    assert out["residual"] < 1e-5, out


def test_local_adam_variance(probes):
    out = probes["powersgd_local"]
    for variance in ("local", "local_debiased"):
        row = out[variance]
        assert row["moved"] > 0.05, row
        # The method as specified (each replica's own v; the momentum in scaled units) ...
        assert row["v"] < 1e-5 and row["w"] < 1e-4, row  # float32 rounding
        # ... keeps every replica's weights and momentum the same, with v each its own.
        assert row["w_replicas_diff"] == 0.0 and row["m_replicas_diff"] == 0.0, row
        assert row["v_replicas_apart"] > 0.1, row
    # Top-k's step over each replica's own v, nothing dropped: the same method; at 10 %
    # (what waits in the residuals differs) the replicas' weights and momenta still agree.
    row = out["topk_1.0"]
    assert row["v"] < 1e-5 and row["w"] < 1e-4, row
    assert row["w_replicas_diff"] == 0.0 and row["m_replicas_diff"] == 0.0, row
    row = out["topk_0.1"]
    assert row["w"] > 1e-3, row  # entries were held back, so it is not the model's
    assert row["w_replicas_diff"] == 0.0 and row["m_replicas_diff"] == 0.0, row
    assert row["v_replicas_apart"] > 0.1, row
    # One gradient for both replicas and a steady denominator: Adam. With different
    # gradients the NumPy model is not Adam (so the check above could fail).
    assert out["same_data_vs_adam"] < 1e-4, out
    assert out["local_vs_adam"] > 0.01, out


def test_bad_variance_settings_are_refused_in_one_line():
    from tfpar.compression import PowerSGDAggregator, TopKAggregator
    for kwargs, match in (({"adam_variance": "warm"}, "adam_variance='warm' is invalid"),
                          ({"adam_refresh_every": -1}, "adam_refresh_every=-1 is invalid"),
                          ({"adam_refresh_every": 2.5}, "adam_refresh_every=2.5 is invalid"),
                          ({"adam_warmup_steps": True}, "adam_warmup_steps=True is invalid")):
        with pytest.raises(ValueError, match=match):
            PowerSGDAggregator(4, adam=(0.9, 0.999, 1e-7), **kwargs)
    # A live v needs the gradient compressed; top-k compresses each replica's Adam step.
    with pytest.raises(ValueError, match="'live' is invalid for TopKAggregator"):
        TopKAggregator(0.1, adam=(0.9, 0.999, 1e-7), adam_variance="live")
    # Each replica's own v needs the momentum synced (ratio >= 1 − β₁).
    for variance in ("local", "local_debiased"):
        with pytest.raises(ValueError, match=f"'{variance}' is invalid for TopKAggregator "
                           "here: .* synced"):
            TopKAggregator(0.05, adam=(0.9, 0.999, 1e-7), adam_variance=variance)
        assert TopKAggregator(0.1, adam=(0.9, 0.999, 1e-7),
                              adam_variance=variance).adam_variance == variance
    # A local v moves every step: no exact refresh steps beside it.
    for variance in ("local", "local_debiased"):
        with pytest.raises(ValueError, match="adam_refresh_every=10 is invalid with "
                           f"adam_variance='{variance}'"):
            PowerSGDAggregator(4, adam_variance=variance, adam_refresh_every=10)
    assert PowerSGDAggregator(4, adam_variance="live").adam_variance == "live"
