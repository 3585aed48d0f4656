"""Keras's state API for a model on a mesh: `get_weights`, `set_weights`,
`variable.assign`, `variable.numpy()`, `save_weights`, `load_weights`, `save`,
`keras.models.load_model`, and Keras's `ModelCheckpoint` and `BackupAndRestore`.

Keras reads and writes every value through three methods of its TensorFlow `Variable`:
`numpy()`, `__array__` (`np.array(variable)`, `.weights.h5` and `.keras` files) and
`_direct_assign` (`assign`, `set_weights`, loading). DTensor refuses the first two for a
sharded DVariable and the third for a host value. After `tfpar.layout.enable()` a variable
whose storage is a DVariable is gathered to the host whole, and a host value is laid out
by the variable's layout before it is written, as Keras's JAX backend does (its
`_direct_assign` calls `distribute_tensor(value, self._layout)`); other variables go
through Keras's own code (`tfpar.patches` entry `mesh_variable_values`).

So a file holds whole arrays, whatever mesh saved it: it loads into a model built under
any distribution (the weights laid out by the current layout map) or none (a plain model).
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import patches
from tfpar.errors import TfparError
from tfpar.layout import values, variables
from tfpar.layout.optimizer import stateless_optimizer
from tfpar.patches import keras_variables


def enable():
    """Hooks Keras's variable reads and writes (called by `tfpar.layout.enable`)."""
    problems = patches.check_targets(["mesh_variable_values"])
    if problems:
        raise TfparError(problems[0])
    keras_variables.set_variable_values(_numpy, _array, _direct_assign)


def disable():
    """Puts Keras's own reads and writes back."""
    keras_variables.set_variable_values(None, None, None)


def _on_mesh(variable):
    return isinstance(patches.variable_storage(variable), dtensor.DVariable)


def _numpy(self):
    if not _on_mesh(self):
        return keras_variables.keras_numpy(self)
    return values.to_host(patches.variable_storage(self))


def _array(self, dtype=None, copy=None):  # numpy 2 passes `copy`; Keras's own takes none
    if not _on_mesh(self):
        return keras_variables.keras_array(self, dtype)
    return np.asarray(values.to_host(patches.variable_storage(self)), dtype=dtype)


def _direct_assign(self, value):
    storage = patches.variable_storage(self)
    if not isinstance(storage, dtensor.DVariable) or not tf.executing_eagerly():
        # inside a compiled mesh step the value is already a DTensor with its layout
        return keras_variables.keras_direct_assign(self, value)
    layout = dtensor.fetch_layout(storage)
    if dtensor.is_dtensor(value):
        if dtensor.fetch_layout(value).mesh == layout.mesh:
            storage.assign(dtensor.relayout(tf.cast(value, storage.dtype), layout))
            return None
        value = values.to_host(value)  # another mesh's (another model's variable)
    host = np.asarray(tf.cast(value, storage.dtype))
    storage.assign(values.to_mesh(host, layout))
    return None


def rebuilt_optimizer(optimizer, model, scope, plain_class=None, prepare=None):
    """`optimizer` (built off the mesh step's path, e.g. by `keras.models.load_model`) made
    again as a stateless optimizer on the mesh, its variables' values copied in.

    Args:
        optimizer: a built Keras optimizer whose class is not a `stateless_optimizer` one.
        model: the model it trains.
        scope: the `keras.distribution.ModelParallel` on the model's mesh whose
            `variables.variable_scope` the new optimizer is built in.
        plain_class: the class to make it of (default: its own); a
            `tfpar.DistributedOptimizer`'s is the Keras class under tfpar's mixins.
        prepare: called with the new optimizer before it is built (tfpar's hooks moved
            onto it); a `nonfinite_steps` counter (`tfpar.nan_guard`) is added after the
            build when the new optimizer skips non-finite steps.

    Raises:
        TfparError: the rebuilt optimizer's variables do not match the loaded ones.
    """
    from tfpar import nan_guard
    old = list(optimizer.variables)
    with variables.variable_scope(scope):
        fresh = (plain_class or optimizer.__class__).from_config(optimizer.get_config())
        if prepare is not None:
            prepare(fresh)
        stateless_optimizer(fresh)
        fresh.build(model.trainable_variables)
        if getattr(fresh, "tfpar_skip_nonfinite", False):  # as `_mesh_trainer` adds it
            nan_guard.add_counter(fresh)
    new = list(fresh.variables)
    if not any(v.path.endswith("nonfinite_steps") for v in new):
        # the loaded optimizer's own counter (a LossScaleOptimizer's inner one): the new
        # optimizer skips through its loss scale
        old = [v for v in old if not v.path.endswith("nonfinite_steps")]
    shapes = ([(v.path, tuple(v.shape)) for v in old], [(v.path, tuple(v.shape)) for v in new])
    if shapes[0] != shapes[1]:  # built by the same class code: the same variables in order
        raise TfparError(f"{type(optimizer).__name__}: its {len(old)} variables cannot be "
                         f"moved onto the mesh step's optimizer ({len(new)} variables); "
                         "compile the model again (model.compile) to start it afresh")
    for source, target in zip(old, new):
        target.assign(np.asarray(source))
    return fresh
