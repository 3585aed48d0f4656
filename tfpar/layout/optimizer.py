"""Keras optimizers that can update stateless-ly on the TensorFlow backend.

The exact DTensor step (`tfpar.layout.step`) calls `optimizer.stateless_apply`, as
Keras's JAX trainer does. Keras's TensorFlow optimizer refuses that ("incompatible with
tf.distribute") and writes through `variable.value.assign`, which bypasses a
`StatelessScope`. Keras's backend-neutral `BaseOptimizer` has the stateless versions of
those methods; `stateless_optimizer` switches an optimizer to them. The update maths
(`update_step` of SGD, Adam, …) is Keras's own, unchanged.

A `keras.optimizers.LossScaleOptimizer` (what `compile` wraps the optimizer in under the
`mixed_float16` policy) keeps its own backend-neutral `stateless_apply`; its inner
optimizer is switched too.
"""

from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.optimizers import base_optimizer

from tfpar.errors import TfparError

# TFOptimizer overrides of BaseOptimizer that go around a StatelessScope or through
# tf.distribute; the BaseOptimizer versions are used instead.
_BASE_METHODS = ("add_variable_from_reference", "stateless_apply", "assign", "assign_add",
                 "assign_sub", "_var_key", "_apply_weight_decay", "_backend_update_step",
                 "_overwrite_model_variables_with_average_value",
                 "_backend_increment_gradient_accumulators")
_classes = {}


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
    if cls in _classes.values():
        return optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        stateless_optimizer(inner)
    if optimizer.built:
        raise TfparError(f"{cls.__name__} is already built; call stateless_optimizer "
                         "before optimizer.build(model.trainable_variables)")
    missing = [m for m in _BASE_METHODS if not hasattr(base_optimizer.BaseOptimizer, m)]
    if missing or not isinstance(optimizer, base_optimizer.BaseOptimizer):
        raise TfparError(f"{cls.__name__} cannot update statelessly (missing "
                         f"{missing or 'BaseOptimizer'}); use a keras.optimizers optimizer")
    if cls not in _classes:
        # Only where the class uses the TensorFlow version: a class's own override (a
        # LossScaleOptimizer's stateless_apply) is kept.
        methods = {m: base_optimizer.BaseOptimizer.__dict__[m] for m in _BASE_METHODS
                   if getattr(cls, m) is getattr(TFOptimizer, m, None)}
        methods["__module__"] = cls.__module__
        _classes[cls] = type(cls.__name__, (cls,), methods)
    optimizer.__class__ = _classes[cls]
    return optimizer
