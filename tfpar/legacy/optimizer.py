"""The tf_keras side of tfpar's one optimizer stack: `wrap_optimizer`'s hook (gradients
summed by a tfpar aggregator) and `make_optimizer` (`tfpar.optimizers.plain_optimizer` on
`tf_keras`). Users call `tfpar.compression.wrap_optimizer` for either Keras generation.

A `tf_keras` (Keras 2) optimizer sums gradients over replicas in its public
`aggregate_gradients(grads_and_vars)`, which `apply_gradients` calls in replica context
(its docstring in tf_keras 2.21: "Users can implement their own aggregation logic by
overriding this method"). Each replica's loss is already divided by the number of replicas,
so the sum is the mean gradient: the contract of `Aggregator.all_reduce_sum`. The wrapped
optimizer's class is a subclass of its own class with that method replaced, under the same
name and module, so `get_config` and saving see the plain optimizer.
"""

import tensorflow as tf
import tf_keras

from tfpar import optimizers, patches


class AggregatingOptimizerMixin:
    """Mixin for a `tf_keras.optimizers.Optimizer` subclass; expects `self.tfpar_aggregator`."""

    def build(self, var_list):
        super().build(var_list)
        # The aggregator's per-replica state is created here, in cross-replica context under
        # the strategy scope, not lazily inside the first traced step.
        if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
            self.tfpar_aggregator.build(list(var_list))

    def aggregate_gradients(self, grads_and_vars):
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            # Nothing to communicate; compressing would only add error.
            return super().aggregate_gradients(grads_and_vars)
        grads, variables = zip(*grads_and_vars)
        summed = self.tfpar_aggregator.all_reduce_sum(list(grads), list(variables))
        return list(zip(summed, variables))


def wrap_optimizer(optimizer, aggregator):
    """Makes a `tf_keras` optimizer sum its gradients over replicas with `aggregator`, in
    place.

    Args:
        optimizer: a `tf_keras.optimizers.Optimizer` (Keras 2's current optimizers; the
            `tf_keras.optimizers.legacy` ones have no `aggregate_gradients`), or a
            `tf_keras.mixed_precision.LossScaleOptimizer` (its inner optimizer is wrapped).
        aggregator: a `tfpar.compression.Aggregator`.

    Returns:
        the same optimizer, with `.tfpar_aggregator`.

    Raises:
        TypeError: `optimizer` is not such an optimizer.

    Examples:
        >>> with strategy.scope():                                        # doctest: +SKIP
        ...     opt = wrap_optimizer(tf_keras.optimizers.Adam(1e-3), Int8Aggregator())
        ...     model.compile(optimizer=opt, loss="mse")
    """
    target = optimizer
    if isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer):
        target = optimizer.inner_optimizer
    if not (isinstance(target, tf_keras.optimizers.Optimizer)
            and hasattr(target, "aggregate_gradients")):
        raise TypeError(f"optimizer={optimizer!r} cannot be wrapped: need a "
                        "tf_keras.optimizers.Optimizer (not a Keras 3 or "
                        "tf_keras.optimizers.legacy optimizer)")
    patches.mix_in(target, AggregatingOptimizerMixin)
    target.tfpar_aggregator = aggregator
    if target is not optimizer:
        optimizer.tfpar_aggregator = aggregator
    return optimizer


def make_optimizer(config):
    """The `tf_keras` optimizer for `config`: the Keras 3 trainer's factory
    (`tfpar.optimizers.plain_optimizer`) on `tf_keras`, and its aggregator."""
    optimizer = optimizers.plain_optimizer(config, tf_keras, warmup=LinearWarmup)
    if config.compression != "none":
        from tfpar import compression
        wrap_optimizer(optimizer, compression.make_aggregator(config, adam_step=False))
    return optimizer


@tf_keras.saving.register_keras_serializable(package="tfpar")
class LinearWarmup(optimizers.WarmupRule, tf_keras.optimizers.schedules.LearningRateSchedule):
    """`peak * min(1, (step + 1) / warmup_steps)` (tf_keras; `tfpar.optimizers.WarmupRule`)."""
