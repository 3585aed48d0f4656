"""Gradient aggregators: replacements for the plain all-reduce of gradients that cut bytes.

Pick one from a `ParallelConfig` with `make_aggregator`, plug it into a Keras optimizer with
`wrap_optimizer`, or call `aggregator.all_reduce_sum(grads, variables)` in replica context
from a custom loop.

Examples:
    >>> agg = make_aggregator(ParallelConfig(compression="topk", topk_ratio=0.01))
    >>> with strategy.scope():                                            # doctest: +SKIP
    ...     model.compile(optimizer=wrap_optimizer(keras.optimizers.Adam(), agg), loss=...)
    >>> model.fit(...); agg.comm_stats()["compression_ratio"]           # doctest: +SKIP
"""

from absl import logging

from tfpar.config import ADAM_FRONT_CODECS, TOPK_RATIO

from tfpar.compression.aggregator import Aggregator
from tfpar.compression.auto import AutoAggregator, LossGuard, link_of
from tfpar.compression.dense import CastAggregator, Int8Aggregator, NoneAggregator
from tfpar.compression.keras_hook import aggregator_of, wrap_optimizer
from tfpar.compression.lowbit import LowBitAggregator
from tfpar.compression.lowrank import PowerSGDAggregator
from tfpar.compression.sparse import ThresholdAggregator, TopKAggregator

__all__ = ["Aggregator", "AutoAggregator", "LossGuard", "aggregator_of", "CastAggregator",
           "Int8Aggregator", "LowBitAggregator", "NoneAggregator", "PowerSGDAggregator",
           "ThresholdAggregator", "ADAM_STEP_AGGREGATORS", "TopKAggregator", "make_aggregator",
           "topk_with_adam_line", "wrap_optimizer"]


# Aggregators that take Adam in front of compression by default (`Aggregator(adam=...)`):
# exact Adam for `adam_warmup_steps`, then compressed Adam steps. Without it top-k's error
# feedback turns gradients into spikes Adam would slow down (docs/guides/compression.md).
ADAM_STEP_AGGREGATORS = ADAM_FRONT_CODECS


def topk_with_adam_line(ratio, union):
    """The one line top-k with Adam logs (the trainer's `--compression=topk`,
    `tfpar.DistributedOptimizer(compression="topk")`): what it sends at `ratio` and `union`,
    and the aggregator that sends >= 10x fewer bytes than fp32 at fp32's quality
    (the quality suite, tools/bench_compression_quality.py: docs/benchmarks/compression.md)."""
    if ratio < TOPK_RATIO or not union:
        cost = (f"below ratio {TOPK_RATIO:g} or without the union top-k ended above fp32's "
                "loss on tasks of the quality suite")
    else:
        cost = (f"at ratio {ratio:g} with the union top-k sends ~0.76x fp32's bytes at 2 "
                "replicas (more from 3: then every tensor goes whole), more than fp16 or int8")
    return (f"compression=topk with Adam: {cost}; compression=lowbit sends ~10x fewer bytes "
            "than fp32 within fp32's band on the quality suite (docs/benchmarks/compression.md)")


def make_aggregator(config, seed=None, dgc_momentum=0.0, adam_step=True, adam=None):
    """The aggregator `config.compression` names, with its parameters from `config`.

    Args:
        config: a `tfpar.ParallelConfig` (already validated).
        seed: PowerSGD's initial-Q seed (default `config.seed`).
        dgc_momentum: for top-k, DGC's momentum correction with this momentum (see
            `TopKAggregator`); the optimizer must then be a Keras `SGD` whose momentum
            `wrap_optimizer` moves into the aggregator (a `tf_keras` optimizer keeps its
            own, so leave it 0 there).
        adam_step: with `config.compress_adam_step` and Adam, top-k and PowerSGD take
            Adam in front of compression (see `Aggregator`); False for optimizers whose
            hook cannot apply steps linearly (`tf_keras`).
        adam: `(beta_1, beta_2, epsilon)` of the run's Adam (default Keras's), which pick
            `v`'s rule before `wrap_optimizer` copies them in again: top-k's own `v` needs
            its ratio >= 1 − beta_1 (`adam_front.default_variance`).

    Returns:
        an `Aggregator`.
    """
    common = {"bucket_mb": config.bucket_mb, "error_feedback": config.error_feedback,
              "timeout_s": config.collective_timeout_s}
    # `auto` too on the trainer's path (`tfpar.DistributedOptimizer` keeps its own choice):
    # with Keras's Adam behind it the quality suite failed (docs/guides/compression.md).
    if (adam_step and config.compress_adam_step and config.optimizer == "adam"
            and config.compression in ADAM_STEP_AGGREGATORS + ("auto",)):
        common["adam"] = tuple(adam) if adam is not None else (0.9, 0.999, 1e-7)
        common["adam_warmup_steps"] = config.adam_warmup_steps
    kind = config.compression
    if kind == "none":
        return NoneAggregator(**common)
    if kind in ("fp16", "bf16"):
        return CastAggregator(kind, **common)
    if kind == "int8":
        return Int8Aggregator(**common)
    if kind == "lowbit":
        if "adam" in common:
            # As PowerSGD: each replica's `v` of its own exact gradient
            # (docs/guides/compression.md).
            common["adam_variance"] = "local_debiased"
        return LowBitAggregator(config.lowbit_bits, **common)
    if kind == "topk":
        if config.optimizer == "adam":
            logging.warning(topk_with_adam_line(config.topk_ratio, config.topk_union))
            if "adam" in common and config.topk_ratio >= 1 - common["adam"][0]:
                # Each replica's `v` moves with its own exact gradient (it needs the momentum
                # synced: `TopKAggregator.adam_sync_momentum`); why: docs/guides/compression.md.
                common["adam_variance"] = "local_debiased"
        return TopKAggregator(config.topk_ratio, momentum=dgc_momentum,
                              warmup_steps=config.topk_warmup_steps,
                              dense_below=config.topk_dense_below, union=config.topk_union,
                              adam_momentum_carry=config.topk_momentum_carry, **common)
    if kind == "threshold":
        return ThresholdAggregator(config.threshold, **common)
    if kind == "auto":
        link = link_of(config.auto_link_mbps, config.auto_link_latency_ms)
        if "adam" in common:
            # Each replica's `v` moves with its own exact gradient, noise counted once
            # (`local_debiased`); why: docs/guides/compression.md.
            common["adam_variance"] = "local_debiased"
        return AutoAggregator(config.auto_budget_ms, link,
                              seed=config.seed if seed is None else seed, **common)
    if "adam" in common:
        # PowerSGD too; why: docs/guides/compression.md.
        common["adam_variance"] = "local_debiased"
    return PowerSGDAggregator(config.powersgd_rank, config.powersgd_start_step,
                              config.seed if seed is None else seed,
                              groups=config.powersgd_groups, **common)
