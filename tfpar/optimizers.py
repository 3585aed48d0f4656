"""The Keras 3 optimizer of a run: learning-rate rule (linear scaling, warm-up), ZeRO
sharding, the gradient aggregator, fp16 loss scaling. Shared by the trainer's backends and the doctor.

>>> from tfpar import ParallelConfig
>>> make_optimizer(ParallelConfig(optimizer="momentum", learning_rate=0.1)).momentum
0.9
"""

import keras

from tfpar import nan_guard

# `--mixed_precision` value -> the Keras dtype policy it sets (Keras 3 and tf_keras alike).
MIXED_PRECISION_POLICIES = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def set_policy(mixed_precision, keras_module=keras):
    """Sets `keras_module`'s global dtype policy for `--mixed_precision` (Keras 3 or
    tf_keras). With "none" it puts back float32 only when the policy in place is one an
    earlier run set (a process that trains several configs must not keep an earlier run's
    bf16/fp16); a policy the user set themselves is left alone."""
    mp = keras_module.mixed_precision
    if mixed_precision != "none":
        mp.set_global_policy(MIXED_PRECISION_POLICIES[mixed_precision])
        _SET_BY_TFPAR[keras_module.__name__] = mp.global_policy().name
    elif _SET_BY_TFPAR.pop(keras_module.__name__, None) == mp.global_policy().name:
        mp.set_global_policy("float32")


_SET_BY_TFPAR = {}  # keras module name -> the policy name tfpar last set on it


@keras.saving.register_keras_serializable(package="tfpar")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """`peak * min(1, (step + 1) / warmup_steps)`."""

    def __init__(self, peak, warmup_steps):
        self.peak, self.warmup_steps = peak, warmup_steps

    def __call__(self, step):
        ramp = keras.ops.cast(step + 1, "float32") / float(self.warmup_steps)
        return self.peak * keras.ops.minimum(1.0, ramp)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps}


def learning_rate(config):
    """The peak rate after the linear scaling rule, with linear warm-up if asked for."""
    peak = config.scaled_learning_rate
    if not config.warmup_steps:
        return peak
    return LinearWarmup(peak, config.warmup_steps)


def make_optimizer(config, bucketed=False):
    """The Keras optimizer for `config`: learning-rate rule, ZeRO sharding (`tfpar.zero`),
    aggregator, fp16 loss scaling. Call under the strategy's scope.

    With `bucketed`, `--compression=none` also goes through an aggregator (the exact fp32
    all-reduce in `--bucket_mb` buckets, last layers first), so the first buckets' sums
    start while backward still runs, where Keras's one all-reduce waits for all of it.
    """
    kwargs = {"learning_rate": learning_rate(config)}
    if config.optimizer == "adam":
        optimizer = keras.optimizers.Adam(**kwargs)
    else:
        optimizer = keras.optimizers.SGD(
            momentum=0.9 if config.optimizer == "momentum" else 0.0, **kwargs)
    if config.zero_stage:
        from tfpar import zero
        optimizer = zero.wrap_optimizer(optimizer, config.zero_stage,
                                        config.collective_timeout_s)
    if config.compression != "none" or bucketed:
        from tfpar import compression
        optimizer = compression.wrap_optimizer(optimizer, compression.make_aggregator(config))
    if config.mixed_precision == "fp16":
        optimizer = nan_guard.ConsistentLossScaleOptimizer(optimizer)
    return optimizer
