"""The Keras 3 optimizer of a run: learning-rate rule (linear scaling, warm-up), ZeRO
sharding, the gradient aggregator, fp16 loss scaling, the fused momentum update. Shared by
the trainer's backends and the doctor.

With `--fused_update` (off by default: see docs/guides/compression.md), momentum SGD's update runs as TensorFlow's one fused
kernel `ResourceApplyKerasMomentum` (`m = m*momentum - lr*g; w += m`, Keras's own formula
for `nesterov=False`, in one pass over `w`, `m` and `g`) instead of Keras's four element-wise
ops and two assignments. `FusedMomentumMixin.update_step` falls back to Keras's
`update_step` wherever the kernel does not apply: a sparse (`IndexedSlices`) gradient,
nesterov, momentum 0 (plain SGD, DGC's momentum in the aggregator), a non-float32 weight,
a DTensor `DVariable` or a stateless (DTensor mesh) update. ZeRO-1/2 update their flat
pieces with their own copy of the formula (`tfpar.zero.sharded`). Slots, their names and
checkpoints are Keras's.

>>> from tfpar import ParallelConfig
>>> make_optimizer(ParallelConfig(optimizer="momentum", learning_rate=0.1)).momentum
0.9
"""

import contextlib

import keras
import tensorflow as tf
from absl import logging

from tfpar import nan_guard, patches

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


class WarmupRule:
    """`peak * min(1, (step + 1) / warmup_steps)`: the body of the warm-up schedule of
    either Keras generation (`LinearWarmup` here, `tfpar.legacy.optimizer.LinearWarmup`
    for tf_keras), each registered with its own Keras's serialization."""

    def __init__(self, peak, warmup_steps):
        self.peak, self.warmup_steps = peak, warmup_steps

    def __call__(self, step):
        ramp = tf.cast(step + 1, tf.float32) / float(self.warmup_steps)
        return self.peak * tf.minimum(1.0, ramp)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps}


@keras.saving.register_keras_serializable(package="tfpar")
class LinearWarmup(WarmupRule, keras.optimizers.schedules.LearningRateSchedule):
    """`peak * min(1, (step + 1) / warmup_steps)` (Keras 3)."""


def learning_rate(config, warmup=LinearWarmup):
    """The peak rate after the linear scaling rule, with linear warm-up (`warmup`, the
    schedule class of the run's Keras) if asked for."""
    peak = config.scaled_learning_rate
    if not config.warmup_steps:
        return peak
    return warmup(peak, config.warmup_steps)


def plain_optimizer(config, keras_module=keras, warmup=LinearWarmup):
    """`config.optimizer` from `keras_module` (Keras 3's `keras`, or `tf_keras`) at the
    learning-rate rule's rate: Adam, SGD, or SGD with momentum 0.9. The one optimizer
    factory of both Keras generations (Horovod's `_keras` takes the module likewise)."""
    kwargs = {"learning_rate": learning_rate(config, warmup)}
    if config.optimizer == "adam":
        return keras_module.optimizers.Adam(**kwargs)
    return keras_module.optimizers.SGD(
        momentum=0.9 if config.optimizer == "momentum" else 0.0, **kwargs)


_BUCKETED = [False]  # what `make_optimizer(config)` takes for `bucketed` (`always_bucketed`)


@contextlib.contextmanager
def always_bucketed():
    """While open, `make_optimizer` builds every run's optimizer with `bucketed=True`: the
    benchmarks' fp32-in-buckets runs (`tools/bench_compression_quality.py`'s `fp32-exact`)
    go through `tfpar.train` unchanged.
    """
    before, _BUCKETED[0] = _BUCKETED[0], True
    try:
        yield
    finally:
        _BUCKETED[0] = before


def make_optimizer(config, bucketed=None):
    """The Keras optimizer for `config`: learning-rate rule, ZeRO sharding (`tfpar.zero.sharded`),
    aggregator, CPU offload (`tfpar.offload`), fp16 loss scaling. Call under the strategy's scope.

    With `bucketed`, `--compression=none` also goes through an aggregator (the exact fp32
    all-reduce in `--bucket_mb` buckets, last layers first), so the first buckets' sums
    start while backward still runs, where Keras's one all-reduce waits for all of it.
    `None` (the default): off, unless inside `always_bucketed()`. `bucketed=True` (the
    trainer's uncompressed path across workers) sends embeddings' `IndexedSlices` as Keras
    does (`NoneAggregator.keras_slices`); inside `always_bucketed()` (the quality suite's
    fp32 reference) they are summed densely, as every lossy aggregator sums them.
    `--bucket_mb=0` turns buckets off: `none` stays on Keras's all-reduce whatever
    `bucketed` says (the baseline `tools/bench_compression.py`'s `none_keras` runs).
    """
    keras_slices = bucketed is True
    if bucketed is None:
        bucketed = _BUCKETED[0]
    if config.bucket_mb == 0:
        bucketed = False
    optimizer = plain_optimizer(config)
    if config.fused_update and config.optimizer == "momentum" and not config.zero_stage:
        fuse_momentum(optimizer)
    if config.zero_stage:
        # ZeRO runs its own collectives, compressed in its codec (`tfpar.zero.sharded`;
        # `tfpar.compat` refuses the others): no aggregator around it.
        from tfpar.zero import sharded as zero
        aggregator = None
        front = zero.adam_in_front(config)  # Adam in front of lowbit, top-k, PowerSGD
        if config.compression in zero.AGGREGATED or front:
            from tfpar import compression
            aggregator = compression.make_aggregator(config, adam_step=front)
        optimizer = zero.wrap_optimizer(
            optimizer, config.zero_stage, config.collective_timeout_s, config.compression,
            config.error_feedback, {"bits": config.lowbit_bits, "ratio": config.topk_ratio,
                                    "dense_below": config.topk_dense_below,
                                    "union": config.topk_union}, aggregator)
    elif config.compression != "none" or bucketed:
        from tfpar import compression
        betas = ((float(optimizer.beta_1), float(optimizer.beta_2), float(optimizer.epsilon))
                 if config.optimizer == "adam" else None)
        aggregator = compression.make_aggregator(config, adam=betas)
        from tfpar import compat, tf_config
        aggregator.allreduce = compat.resolve_allreduce(config, tf_config.load())
        if config.compression == "none":
            aggregator.keras_slices = keras_slices
        optimizer = compression.wrap_optimizer(optimizer, aggregator)
    if config.offload != "none":
        # Slots and update on the host (`tfpar.offload`); with ZeRO, each replica's piece.
        from tfpar import offload
        optimizer = offload.wrap_optimizer(optimizer, config.offload)
    if config.mixed_precision == "fp16":
        optimizer = nan_guard.ConsistentLossScaleOptimizer(optimizer)
    return optimizer


class FusedMomentumMixin:
    """Mixin for `keras.optimizers.SGD` (TensorFlow backend): `update_step` through
    TensorFlow's fused `ResourceApplyKerasMomentum` where it applies (see the module
    docstring), Keras's own `update_step` everywhere else."""

    def update_step(self, gradient, variable, learning_rate):
        slot = self._tfpar_fused_slot(gradient, variable)
        if slot is None:
            return super().update_step(gradient, variable, learning_rate)
        # Counted while tracing: tests see that the kernel was used, not Keras's update.
        self.tfpar_fused_traced = getattr(self, "tfpar_fused_traced", 0) + 1
        dtype = variable.dtype
        # Inside `Strategy.extended.update` the mirrored slot's handle is this replica's
        # component, on the same device as `variable`.
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle, accum=slot.handle, lr=tf.cast(learning_rate, dtype),
            grad=tf.cast(gradient, dtype), momentum=tf.cast(self.momentum, dtype),
            use_locking=False, use_nesterov=False)

    def _tfpar_fused_slot(self, gradient, variable):
        """The momentum slot's `tf.Variable` when the fused kernel computes exactly
        Keras's update for this variable, else None."""
        if (not self.momentum or self.nesterov or not isinstance(gradient, tf.Tensor)
                or isinstance(variable, (keras.Variable, tf.experimental.dtensor.DVariable))
                or not isinstance(variable, tf.Variable) or variable.dtype != tf.float32):
            return None
        slot = self.momentums[self._get_variable_index(variable)].value
        if slot.dtype != variable.dtype or isinstance(slot, tf.experimental.dtensor.DVariable):
            return None
        return slot


def fuse_momentum(optimizer):
    """Makes a `keras.optimizers.SGD` update through `FusedMomentumMixin`, in place; the
    class keeps its name, config and slots (`patches.mix_in`). Left as it is, with a
    warning, if Keras's `SGD.update_step` is no longer the formula the kernel computes
    (registry entry `fused_momentum`).

    >>> opt = fuse_momentum(keras.optimizers.SGD(0.1, momentum=0.9))
    >>> isinstance(opt, FusedMomentumMixin), type(opt).__name__
    (True, 'SGD')
    """
    problems = patches.check_targets(["fused_momentum"])
    if problems:
        logging.warning("momentum SGD keeps Keras's update: %s", "; ".join(problems))
        return optimizer
    return patches.mix_in(optimizer, FusedMomentumMixin)
