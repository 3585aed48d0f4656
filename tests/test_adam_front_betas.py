"""Adam in front of top-k picks the rule for `v` by the run's own beta_1: each replica's own
`v` needs top-k's momentum synced, which it is at ratio >= 1 - beta_1
(`tfpar.compression.adam_front.default_variance`). Picked with Keras's default 0.9 instead,
a `DistributedOptimizer` over `Adam(beta_1=0.8)` at ratio 0.15 raised (its own `v` chosen,
then refused once the real beta_1 was copied in) and one over `Adam(beta_1=0.95)` at ratio
0.08 froze `v` where its momentum is synced. No mesh, no training: the aggregators only.
"""

import keras
import pytest

import tfpar
from tfpar import ParallelConfig, compression

# (beta_1, top-k ratio, the rule for `v`): only near ratio 1 - beta_1 does beta_1 decide.
CASES = [(0.95, 0.08, "local_debiased"), (0.8, 0.15, "frozen"),
         (0.9, 0.08, "frozen"), (0.9, 0.15, "local_debiased")]


@pytest.mark.parametrize("beta_1,ratio,variance", CASES)
def test_distributed_optimizer_picks_v_by_its_adams_beta_1(beta_1, ratio, variance):
    optimizer = tfpar.DistributedOptimizer(keras.optimizers.Adam(beta_1=beta_1),
                                           compression="topk", ratio=ratio)
    aggregator = compression.aggregator_of(optimizer)
    assert aggregator.adam[0] == pytest.approx(beta_1)
    assert aggregator.adam_variance == variance
    assert aggregator.adam_sync_momentum == (variance != "frozen")


@pytest.mark.parametrize("beta_1,ratio,variance", CASES)
def test_make_aggregator_picks_v_by_the_betas_it_is_given(beta_1, ratio, variance):
    config = ParallelConfig(compression="topk", topk_ratio=ratio, optimizer="adam")
    aggregator = compression.make_aggregator(config, adam=(beta_1, 0.999, 1e-7))
    assert aggregator.adam_variance == variance
    # and wrapping an Adam of those betas keeps it (the check `wrap_optimizer` repeats)
    compression.wrap_optimizer(keras.optimizers.Adam(beta_1=beta_1), aggregator)
    assert aggregator.adam_variance == variance
