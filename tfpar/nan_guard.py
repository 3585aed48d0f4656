"""Non-finite losses and gradients: stop with the step named, or skip the update.

In both modes the optimizer counts steps whose all-reduced gradients hold a NaN or Inf.
With skip_step it also leaves weights and slots untouched on them: the test runs inside
each variable's update function on the gradients every replica (and worker) received from the same all-reduce,
so all of them skip together. (A `cond` around the whole update, the obvious design, fails
under `MirroredStrategy`: Keras's update step calls `merge_call`.) The optimizer's
iteration counter still advances on a skipped step. A NaN input always gives NaN
gradients (the first layer's kernel gradient multiplies the input), while whether the loss
turns NaN too depends on the CPU (a vectorised ReLU may map NaN to 0 or keep it): the
gradients are what is checked, and a step whose gradients are not finite is named as such
whatever the loss did.

`--on_nan=stop` then ends the run with one line naming the step (without the per-variable
branch, which costs a few percent of a step on models with many variables);
`--on_nan=skip_step` logs it and trains on.
"""

import math

import keras
import tensorflow as tf
from absl import logging

from tfpar import patches
from tfpar.errors import TfparError



@keras.saving.register_keras_serializable(package="tfpar")
class ConsistentLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras's fp16 `LossScaleOptimizer`, with replicas agreeing on "gradients finite".

    Keras decides to skip a step (and halve the scale) from each replica's local gradients
    and, under `MirroredStrategy`, takes replica 0's answer. Across workers each decides
    alone: a worker whose gradients overflowed skips the update's all-reduce while the
    others wait in it until the collective times out. Here one all-reduce of the flags
    makes every replica on every worker take the same branch.
    """

    def check_finite(self, grads):
        finite = super().check_finite(grads)
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return finite
        overflowed = ctx.all_reduce("SUM", 1.0 - tf.cast(finite, tf.float32))
        return tf.equal(overflowed, 0.0)


def add_counter(optimizer):
    """`optimizer.nonfinite_steps`, the count of steps skipped for non-finite gradients
    (created once, in `build`; tfpar's, kept out of Keras's saved file)."""
    if not hasattr(optimizer, "nonfinite_steps"):
        optimizer.nonfinite_steps = optimizer.add_variable(
            (), "zeros", "float32", aggregation="only_first_replica", name="nonfinite_steps")


class SkipNonFiniteMixin:
    """Overrides Keras's TF optimizer `_backend_update_step` (keras 3.15.1): the same
    all-reduce and update, each variable's update guarded by "all reduced gradients are
    finite", and a count of the steps skipped (`nonfinite_steps`)."""

    def build(self, variables):
        super().build(variables)
        add_counter(self)

    # Keras's file (`model.save`, `save_weights`) holds the plain optimizer's variables only,
    # so stock Keras loads its state (the counter is tfpar's; checkpoints keep it).
    def _plain_variables(self):
        counter = getattr(self, "nonfinite_steps", None)
        return [v for v in self.variables if v is not counter]

    def save_own_variables(self, store):
        for i, variable in enumerate(self._plain_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        plain = self._plain_variables()
        if len(store.keys()) != len(plain):  # a file with the counter, or a mismatch
            return super().load_own_variables(store)
        for i, variable in enumerate(plain):
            variable.assign(store[str(i)])

    # Keras's private step, overridden: registry entry `optimizer_hooks` of tfpar.patches.
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        variables = [v.value if isinstance(v, keras.Variable) else v
                     for v in trainable_variables]
        grads_and_vars = self._all_reduce_sum_gradients(list(zip(grads, variables)))
        if self.tfpar_skip_nonfinite or _checks_the_sums():
            finite = sums_finite([g for g, _ in grads_and_vars if g is not None],
                                 getattr(self, "sums_certainly_finite", lambda: None)())
        else:
            finite = tf.constant(True)  # not read: this worker's first replica's flag counts
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._guarded_update, self._distribution_strategy, grads_and_vars, learning_rate,
            finite)

    def _guarded_update(self, distribution, grads_and_vars, learning_rate, finite):
        if not self.tfpar_skip_nonfinite:
            # Only count (the run stops at this step): no per-variable branch on the hot path.
            self._distributed_tf_update_step(distribution, grads_and_vars, learning_rate)
            # This worker's first replica's flag for its replicas (in a merge; else each's
            # own), its increment made once and added to every device's copy of the counter.
            finite = distribution.experimental_local_results(finite)[0]
            increment = 1.0 - tf.cast(finite, tf.float32)
            distribution.extended.update(
                self.nonfinite_steps.value, lambda count, increment: count.assign_add(increment),
                args=(increment,), group=False)
            return

        # `finite` is per replica; `update` hands each device its own (equal) value.
        def step(var, grad, learning_rate, finite):
            return tf.cond(finite,
                           lambda: _as_op(self.update_step(grad, var, learning_rate)),
                           tf.no_op)

        for grad, var in grads_and_vars:
            distribution.extended.update(var, step, args=(grad, learning_rate, finite),
                                         group=False)
        distribution.extended.update(
            self.nonfinite_steps.value,
            lambda count, finite: count.assign_add(1.0 - tf.cast(finite, tf.float32)),
            args=(finite,), group=False)


def sums_finite(sums, known=None):
    """A boolean tensor: every one of `sums` (the all-reduced gradients) is finite. One pass
    per gradient: a NaN or Inf anywhere makes its sum non-finite (a finite sum overflowing
    float32 would need gradients near 1e38). `known`: an aggregator's word from small
    tensors (PowerSGD's factors, `sums_certainly_finite`), true only if they are all
    finite: the pass then runs only where it is not true."""
    def exact():
        return tf.math.is_finite(tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32))
                                           for g in sums]))

    return exact() if known is None else tf.cond(known, lambda: tf.constant(True), exact)


def _checks_the_sums():
    """Whether this replica makes the pass over the summed gradients when the run only
    counts (`skip=False`). Under `MirroredStrategy` (the update goes through `merge_call`)
    every replica holds the same sums (a NaN or Inf from any replica is in all of them), so
    replica 0's pass tells all instead of R passes over the same values; without a merge
    each replica checks its own; across workers with a merge, each worker's first."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or tf.__internal__.distribute.strategy_supports_no_merge_call():
        return True
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    # The first replica of this worker: the merge takes the first local replica's flag
    # (`_guarded_update`), and across workers each worker's own (replica 0 alone once left
    # the other workers counting no step, so only worker 0 stopped).
    local = len(tf.distribute.get_strategy().extended.worker_devices)
    return replica is None or int(replica) % local == 0


def _as_op(result):
    return tf.group(result) if result is not None else tf.no_op()


def skip_nonfinite_updates(optimizer, skip=True):
    """Makes `optimizer` (Keras 3, TF backend) count steps whose all-reduced gradients are
    not finite in `optimizer.nonfinite_steps` and, with `skip`, leave weights and slots
    untouched on them; in place. Call before the optimizer is built. A
    `LossScaleOptimizer` (fp16) already skips such steps: it is left as it is."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    optimizer.tfpar_skip_nonfinite = skip
    if hasattr(optimizer, "tfpar_zero_stage") or hasattr(optimizer, "tfpar_offload"):
        # A ZeRO update (tfpar.zero) counts and skips on its own pieces, an offloaded one
        # (tfpar.offload) on the host.
        return optimizer
    patches.mix_in(optimizer, SkipNonFiniteMixin)
    return optimizer


class NaNGuard(keras.callbacks.Callback):
    """Watches each step: a non-finite loss, or an update the optimizer skipped for
    non-finite gradients, raises `TfparError` (stop) or is logged as skipped.

    Args:
        on_nan: "stop" or "skip_step"; None: the optimizer's (`tfpar.DistributedOptimizer(
            on_nan=...)`, "stop" for any other).
        hint: what the stop's line suggests (the trainer's flags by default).
    """

    def __init__(self, on_nan=None, hint=None):
        super().__init__()
        self.on_nan = on_nan
        self.hint = hint or ("lower --learning_rate, use --mixed_precision=bf16 instead of "
                             "fp16, check the data, or pass --on_nan=skip_step")
        self.step = 0  # steps done; set to the resume step before training
        self.skipped = []

    def _counter_variable(self):
        """The device copy of the optimizer's `nonfinite_steps` this guard reads, or None.

        Replica 0's (every replica counts the same steps), which is what reading the
        mirrored variable returns, read directly: through the Keras and mirrored wrappers
        a read took 3x the host time, every step (docs/benchmarks/data_parallel.md)."""
        # A pipeline's stage optimizers update, each counting the same skipped steps.
        optimizer = (getattr(self.model, "stage_optimizers", None) or [None])[-1] \
            or self.model.optimizer
        counter = getattr(optimizer, "nonfinite_steps", None)
        if counter is None:
            return None
        if isinstance(counter, keras.Variable):
            counter = counter.value
        return self.model.distribute_strategy.experimental_local_results(counter)[0]

    def _counter(self):
        return 0.0 if self._variable is None else float(self._variable.numpy())

    def on_train_begin(self, logs=None):
        if self.on_nan is None:
            optimizer = self.model.optimizer
            optimizer = getattr(optimizer, "inner_optimizer", optimizer)
            self.on_nan = getattr(optimizer, "tfpar_on_nan", "stop")
        self._variable = self._counter_variable()
        self._count = self._counter()

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        loss = float((logs or {}).get("loss", 0.0))
        count = self._counter()
        bad_grads, self._count = count > self._count, count
        if math.isfinite(loss) and not bad_grads:
            return
        # Gradients first: they are non-finite whenever the input was, on every CPU; the
        # loss only on some (see the module docstring).
        what = "gradients became non-finite" if bad_grads else f"loss became {loss}"
        if self.on_nan == "stop":
            raise TfparError(f"{what} at step {self.step - 1} (on_nan=stop); {self.hint}")
        self.skipped.append(self.step - 1)
        logging.warning("step %d: %s; its update was skipped (on_nan=skip_step)",
                        self.step - 1, what)
        # Else one NaN would spoil the running mean Keras logs for the rest of the epoch.
        patches.loss_tracker(self.model).reset_state()
