"""`wrap_optimizer`: makes a Keras 3 optimizer sum gradients through a tfpar aggregator.

Keras 3's TensorFlow optimizer all-reduces gradients in
`TFOptimizer._all_reduce_sum_gradients`, called in replica context from
`_backend_update_step`, with each replica's gradients already divided by the number of
replicas. The wrapped optimizer's class is a subclass of its own class with that one method
replaced, so `model.compile(optimizer=wrapped)` + `model.fit` under a strategy scope use the
aggregator and nothing else changes (a custom `train_step` alone could not avoid Keras's own
all-reduce). `aggregator.trace_count` grows when the hook is traced; tests assert it, so a
Keras upgrade that stops calling the method fails loudly. The overrides of Keras's private
methods are registry entry `optimizer_hooks` of `tfpar.patches`, which checks the code they
replace.
"""

import keras
import tensorflow as tf

from tfpar import patches
from tfpar.compression import collectives


class AggregatingOptimizerMixin:
    """Mixin for a Keras `TFOptimizer` subclass; expects `self.tfpar_aggregator`."""

    def build(self, variables):
        super().build(variables)
        # Create the aggregator's per-replica state now, in cross-replica context under the
        # strategy scope, rather than lazily inside the first traced step.
        # Under keras.distribution the mesh's step compresses through its own reduction
        # (`tfpar.layout.reduction`, state laid out like the gradients): none built here.
        on_mesh = keras.distribution.distribution() is not None
        if not on_mesh and (not tf.distribute.has_strategy()
                            or tf.distribute.in_cross_replica_context()):
            self.tfpar_aggregator.build(
                [v.value if isinstance(v, keras.Variable) else v for v in variables])

    # Keras's private hook, overridden: registry entry `optimizer_hooks` of tfpar.patches.
    def _all_reduce_sum_gradients(self, grads_and_vars):
        ctx = tf.distribute.get_replica_context()
        self._tfpar_sums_finite = None  # see `sums_certainly_finite`
        if ctx is None or ctx.num_replicas_in_sync == 1:
            # Nothing to communicate; compressing would only add error. A debt loaded from
            # more replicas (`tfpar.state` sets `debt_owed`) is paid here, once.
            grads_and_vars = pay_debt(self.tfpar_aggregator, grads_and_vars)
            return super()._all_reduce_sum_gradients(grads_and_vars)
        grads, variables = zip(*grads_and_vars)
        if getattr(self, "tfpar_skip_nonfinite", False):
            summed = self._skip_nonfinite_sum(ctx, list(grads), list(variables))
        else:
            summed = self.tfpar_aggregator.all_reduce_sum(list(grads), list(variables))
            hint = getattr(self.tfpar_aggregator, "certainly_finite", lambda: None)()
            if all(g is None or g.dtype == tf.float32 for g in grads):
                # (a narrower gradient's sum is cast down after the check: it could overflow)
                self._tfpar_sums_finite = hint
        # With Adam moved into the aggregator, what comes back are Adam's steps, applied
        # linearly by `update_step` below (set while tracing, before the updates are traced).
        self._tfpar_linear = getattr(self.tfpar_aggregator, "adam", None) is not None
        return list(zip(summed, variables))

    def sums_certainly_finite(self):
        """For `tfpar.nan_guard`, right after `_all_reduce_sum_gradients` in the same trace:
        a boolean tensor, true only if every sum it handed back is finite, from what the
        aggregator knows cheaply (PowerSGD: its factors, `certainly_finite`), or None (check
        the sums)."""
        return getattr(self, "_tfpar_sums_finite", None)

    def _skip_nonfinite_sum(self, ctx, grads, variables):
        """`--on_nan=skip_step`: the aggregator runs only when every replica's gradients are
        finite. Its state (error-feedback residuals, PowerSGD's Q, Adam's moments in front)
        is written inside the step, before the optimizer's guard sees the sums, so a NaN
        let through once would sit in a residual and make every later step non-finite (every
        step after the bad one was skipped). One float all-reduced decides on every replica
        alike; a skipped step hands back NaN, which the guard counts and skips
        (`tfpar.nan_guard`), and leaves the aggregator's state as it was."""
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in present]
        local_ok = tf.math.is_finite(tf.add_n(
            [tf.reduce_sum(tf.cast(g, tf.float32)) for g in dense]))
        bad = ctx.all_reduce("SUM", 1.0 - tf.cast(local_ok, tf.float32))
        subset = [variables[i] for i in present]

        def aggregate(*gs):
            return self.tfpar_aggregator.all_reduce_sum(list(gs), subset)

        def skip(*gs):
            return [tf.fill(tf.shape(g), tf.constant(float("nan"), g.dtype)) for g in gs]

        out = collectives.replica_cond(tf.equal(bad, 0.0), aggregate, skip, tuple(dense))
        summed = list(grads)
        for i, s in zip(present, out):
            summed[i] = s
        return summed

    def update_step(self, gradient, variable, learning_rate):
        if not getattr(self, "_tfpar_linear", False):
            return super().update_step(gradient, variable, learning_rate)
        lr = tf.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, lr * tf.cast(gradient, variable.dtype))

    # Keras's private step, overridden (`optimizer_hooks`): BaseOptimizer's own, with the
    # accumulate-or-update choice through `replica_cond`.
    def _backend_apply_gradients(self, grads, trainable_variables):
        # Keras runs the accumulate-or-update choice as a tf.cond in replica context, which
        # MirroredStrategy rejects as soon as a branch all-reduces (stock Keras 3.15 fails
        # the same way); run the choice through `replica_cond` instead.
        if (not self.gradient_accumulation_steps or self.use_ema
                or tf.__internal__.distribute.strategy_supports_no_merge_call()
                or tf.distribute.get_replica_context() is None):
            return super()._backend_apply_gradients(grads, trainable_variables)
        steps = self.gradient_accumulation_steps
        acc_grads = [self._accumulated_gradients[self._get_variable_index(v)]
                     for v in trainable_variables]

        def update(grads):
            grads = [(g + a) / steps for g, a in zip(grads, acc_grads)]
            grads = self._clip_gradients(grads)
            self._apply_weight_decay(trainable_variables)
            self._backend_update_step(grads, trainable_variables, self.learning_rate)
            self._backend_reset_gradient_accumulators()
            return tf.constant(True)

        def accumulate(grads):
            self._backend_increment_gradient_accumulators(grads, acc_grads)
            return tf.constant(False)

        is_update_step = (self._iterations + 1) % steps == 0
        collectives.replica_cond(is_update_step, update, accumulate, (list(grads),))


def pay_debt(aggregator, grads_and_vars):
    """`grads_and_vars` with a debt `aggregator` loaded from more replicas added, on one
    replica (nothing compressed there, so no step sends its error-feedback residuals):
    while its `debt_owed` flag is set (`tfpar.state`), each residual is added to its
    weight's gradient; where the step is applied the residuals then turn zero and the flag
    clears. A step whose gradients are not finite (skipped by `--on_nan=skip_step`,
    `tfpar.nan_guard`, by the same test: the sum of every gradient finite) keeps both, so
    the next applied step pays; a residual of a weight without a gradient on that step
    (Keras drops None gradients) keeps the flag set until a step with its gradient pays it
    too. (fp16's loss scaling never calls this on an overflowing
    step: Keras skips the whole update.) Each residual is in the gradient's units there
    (Keras divides by 1 replica), its row the saved rows' sum (`tfpar.state`)."""
    flag = getattr(aggregator, "debt_owed", None)
    if flag is None:
        return grads_and_vars
    owed, paying = {}, set()
    for j, (g, v) in enumerate(grads_and_vars):
        position = aggregator.position_of(v)
        residual = (aggregator.residuals.get(str(position)) if position is not None
                    else None)
        if g is not None and residual is not None:
            owed[j] = residual
            paying.add(str(position))
    # Residuals of weights without a gradient this step (Keras drops None gradients): not
    # paid here, so the flag stays set while one of them holds a debt.
    waiting = [r for k, r in aggregator.residuals.items() if k not in paying]
    if not owed:
        return grads_and_vars
    grads = [g for g, _ in grads_and_vars]

    def parts(j, residual=None):
        """Gradient `j` as the tensors the `tf.cond` hands back, with `residual` added:
        dense, or an embedding's rows (`IndexedSlices`) with every row of it appended."""
        g = grads[j]
        if isinstance(g, tf.IndexedSlices):
            if residual is None:
                return [g.values, g.indices]
            rows = tf.range(tf.shape(residual, out_type=g.indices.dtype)[0])
            return [tf.concat([g.values, tf.cast(residual, g.values.dtype)], 0),
                    tf.concat([g.indices, rows], 0)]
        g = tf.convert_to_tensor(g)
        return [g if residual is None else g + tf.cast(residual, g.dtype)]

    def pay():
        debts = {j: tf.convert_to_tensor(r) for j, r in owed.items()}
        paid = [parts(j, debts[j]) for j in owed]
        others = [tf.convert_to_tensor(g) for j, g in enumerate(grads)
                  if g is not None and j not in owed]
        applied = tf.math.is_finite(tf.add_n(
            [tf.reduce_sum(tf.cast(x, tf.float32)) for p in paid for x in p[:1]]
            + [tf.reduce_sum(tf.cast(x, tf.float32)) for x in others]))
        writes = [r.assign(tf.where(applied, tf.zeros_like(debts[j]), debts[j]))
                  for j, r in owed.items()]
        unpaid = tf.reduce_any([tf.reduce_any(tf.not_equal(tf.convert_to_tensor(r), 0))
                                for r in waiting]
                               or [tf.constant(False)])
        writes.append(flag.assign(tf.logical_or(tf.logical_not(applied), unpaid)))
        with tf.control_dependencies(writes):
            return [tf.identity(x) for p in paid for x in p]

    def keep():
        return [x for j in owed for x in parts(j)]
    flat = iter(tf.cond(tf.convert_to_tensor(flag), pay, keep))
    out = list(grads_and_vars)
    for j in owed:
        g, v = grads_and_vars[j]
        if isinstance(g, tf.IndexedSlices):
            out[j] = (tf.IndexedSlices(next(flat), next(flat), g.dense_shape), v)
        else:
            out[j] = (next(flat), v)
    return out


def aggregator_of(optimizer):
    """The tfpar aggregator `optimizer` sums gradients with, looking through wrappers such
    as a `LossScaleOptimizer`; None for a plain optimizer."""
    aggregator = getattr(optimizer, "tfpar_aggregator", None)
    inner = getattr(optimizer, "inner_optimizer", None)
    return aggregator if aggregator is not None or inner is None else aggregator_of(inner)


def wrap_optimizer(optimizer, aggregator):
    """Makes `optimizer` sum its gradients over replicas with `aggregator`, in place.

    Args:
        optimizer: a Keras 3 optimizer (TensorFlow backend), or a `LossScaleOptimizer`
            (its inner optimizer is wrapped; loss scaling is unaffected); or a `tf_keras`
            optimizer, hooked by `tfpar.legacy.optimizer.wrap_optimizer`.
        aggregator: a `tfpar.compression.Aggregator`.

    Returns:
        the same `optimizer`, now with `.tfpar_aggregator`; checkpoints of the optimizer
        (`tf.train.Checkpoint(optimizer=...)`) include the aggregator's state.

    Raises:
        TypeError: `optimizer` is not a Keras optimizer on the TensorFlow backend.
        ValueError: the aggregator does DGC momentum correction (`TopKAggregator(momentum=
            m)`) and `optimizer` is not a plain `SGD`; its momentum is set to 0 otherwise,
            since the aggregator now applies it.

    Examples:
        >>> with strategy.scope():                                        # doctest: +SKIP
        ...     opt = wrap_optimizer(keras.optimizers.Adam(1e-3), TopKAggregator(0.01))
        ...     model.compile(optimizer=opt, loss="mse")
    """
    if type(optimizer).__module__.startswith("tf_keras"):  # Keras 2: its own hook
        from tfpar.legacy import optimizer as tf_keras_optimizer
        return tf_keras_optimizer.wrap_optimizer(optimizer, aggregator)
    target = optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        target = optimizer.inner_optimizer
    if not patches.is_tf_optimizer(target):
        raise TypeError(
            f"optimizer={optimizer!r} cannot be wrapped: need a Keras 3 optimizer on the "
            f"TensorFlow backend (KERAS_BACKEND=tensorflow)")
    if getattr(aggregator, "momentum", 0):
        # DGC momentum correction: the aggregator keeps the velocity per replica and hands
        # back the summed velocity update, which the optimizer must apply as plain SGD.
        if not isinstance(target, keras.optimizers.SGD) or target.nesterov:
            raise ValueError(
                f"aggregator={type(aggregator).__name__}(momentum={aggregator.momentum}) "
                f"needs keras.optimizers.SGD without nesterov, got optimizer={target!r}; "
                "use momentum=0 on the aggregator for other optimizers")
        target.momentum = 0.0
    if getattr(aggregator, "adam", None) is not None:
        # Adam in front of compression: the aggregator keeps the moments of each replica's
        # own gradient and the optimizer applies the summed steps linearly.
        if not isinstance(target, keras.optimizers.Adam) or target.amsgrad:
            raise ValueError(
                f"aggregator={type(aggregator).__name__}(adam=...) needs "
                f"keras.optimizers.Adam without amsgrad, got optimizer={target!r}; build "
                "the aggregator from a config whose optimizer matches (make_aggregator("
                "ParallelConfig(optimizer='sgd', ...))) or with compress_adam_step=False")
        aggregator.adam = (float(target.beta_1), float(target.beta_2), float(target.epsilon))
        # Checked again with these betas: each replica's own `v` on top-k needs its ratio
        # >= 1 − beta_1 (one line naming both otherwise).
        aggregator.set_adam_variance(aggregator.adam_variance, aggregator.adam_refresh_every)
    patches.mix_in(target, AggregatingOptimizerMixin)
    target.tfpar_aggregator = aggregator
    if target is not optimizer:
        optimizer.tfpar_aggregator = aggregator
    if target.built and not aggregator.built:
        aggregator.build([v.value for v in patches.built_variables(target)])
    return optimizer
