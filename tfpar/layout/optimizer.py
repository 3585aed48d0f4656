"""Keras optimizers that can update stateless-ly on the TensorFlow backend.

The exact DTensor step (`tfpar.layout.step`) calls `optimizer.stateless_apply`, as
Keras's JAX trainer does. Keras's TensorFlow optimizer refuses that ("incompatible with
tf.distribute") and writes through `variable.value.assign`, which bypasses a
`StatelessScope`. Keras's backend-neutral `BaseOptimizer` has the stateless versions of
those methods; `stateless_optimizer` switches an optimizer to them (registry entry
`stateless_optimizer` of `tfpar.patches`, which lists the methods). The update maths
(`update_step` of SGD, Adam, …) is Keras's own, unchanged.

A `keras.optimizers.LossScaleOptimizer` (what `compile` wraps the optimizer in under the
`mixed_float16` policy) keeps its own backend-neutral `stateless_apply`; its inner
optimizer is switched too.
"""

import tensorflow as tf

from tfpar import patches
from tfpar.errors import TfparError


def stateless_optimizer(optimizer):
    """Makes `optimizer` update through Keras's backend-neutral path (in place).

    Call before `optimizer.build`: variable lookup keys differ between the two paths.

    Args:
        optimizer: an unbuilt Keras optimizer (`keras.optimizers.SGD`, `Adam`, …).

    Returns:
        The same optimizer, whose class is now a subclass of its class with the same
        name; `get_config` and checkpoints are unchanged.

    Raises:
        TfparError: the optimizer is already built, or does not come from Keras's
            TensorFlow optimizer base.
    """
    cls = type(optimizer)
    if patches.is_stateless_class(cls):
        return optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        stateless_optimizer(inner)
    if optimizer.built:
        raise TfparError(f"{cls.__name__} is already built; call stateless_optimizer "
                         "before optimizer.build(model.trainable_variables)")
    problems = patches.check_targets(["stateless_optimizer"])
    if problems or not patches.is_base_optimizer(optimizer):
        raise TfparError(f"{cls.__name__} cannot update statelessly "
                         f"({'; '.join(problems) or 'not a Keras BaseOptimizer'}); use a "
                         "keras.optimizers optimizer")
    return patches.to_stateless(optimizer)


class StepApplyingMixin:
    """Mixed into an optimizer whose gradients are already its steps (Adam in front of the
    mesh's codec, `tfpar.layout.adam_front`): each weight moves by `learning_rate · step`,
    as tf.distribute's Adam in front applies its summed steps (`keras_hook`)."""

    def update_step(self, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, lr * tf.cast(gradient, variable.dtype))


def applies_steps(optimizer):
    """Makes `optimizer` apply its gradients as steps (`StepApplyingMixin`), in place;
    `get_config` and checkpoints are unchanged (its own slots stay as built)."""
    return patches.mix_in(optimizer, StepApplyingMixin)
