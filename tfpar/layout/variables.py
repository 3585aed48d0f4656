"""Keras variables created as DTensor `DVariable`s with their layout.

Inside `variable_scope(distribution)` every Keras variable — model weights, optimizer
slots, the optimizer's `iterations` and learning rate, seed-generator state — is created
as a `DVariable`: the path is looked up in the distribution's `LayoutMap`, unmatched
variables are replicated. This is what the JAX backend's `Variable._initialize` does and
Keras's TensorFlow backend does not (there `ModelParallel` leaves every variable plain).
An optimizer slot is created with its weight's `_layout`, so it is sharded like it.

Initial values are computed whole, exactly as on one device, then split: a model built
with the same seed starts from the same weights on every mesh.

Measured: a plain `tf.Variable` in a DTensor step is updated once per device (a plain
`iterations` ended at 16 or 19 after 5 steps on 4 devices), so `check_dvariables`
refuses any variable that is not a DVariable before a step runs.
"""

import contextlib

import keras
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from tfpar import patches
from tfpar.errors import ConfigError, TfparError
from tfpar.layout import mesh as mesh_lib
from tfpar.layout import values

_original_initialize = patches.VARIABLE_INITIALIZE  # Keras's own
_state_over_batch = False  # see optimizer_state_over_batch
_weights_over_batch = False  # see weights_over_batch


def check_target():
    """Raises `TfparError` if Keras's `Variable._initialize` is not the code this module
    was written against (`tfpar.patches.REGISTRY["mesh_variables"]`)."""
    problems = patches.check_targets(["mesh_variables"])
    if problems:
        raise TfparError(problems[0])


def layout_for(distribution, path, shape, preset=None):
    """The `keras.distribution.TensorLayout` a variable gets.

    Args:
        distribution: a `keras.distribution.ModelParallel` (or any `Distribution`).
        path: the variable's path, e.g. `block_0/mlp_fc/kernel`.
        shape: its shape.
        preset: a layout already attached to the variable (optimizer slots carry their
            weight's), used instead of the layout map.

    Returns:
        The layout; replicated when no rule matches, or when a split dimension does not
        divide over the `model` axis (logged: e.g. a vocabulary of 17 over 2 devices).

    Raises:
        ConfigError: a matching rule has a different rank than the variable.
    """
    mesh = distribution.device_mesh
    whole = keras.distribution.TensorLayout([None] * len(shape), mesh)
    layout = preset
    if layout is None:
        layout_map = patches.layout_map(distribution)
        layout = layout_map[path] if layout_map is not None else None
    if layout is None:
        return whole
    if len(layout.axes) != len(shape):
        raise ConfigError("layout", f"{path}: {layout.axes}",
                          f"the variable has shape {tuple(shape)}; give one axis entry "
                          "per dimension")
    for dim, axis in zip(shape, layout.axes):
        if axis is not None and dim % mesh_lib.axis_size(mesh, axis):
            logging.warning("%s: dimension %d does not split over %s=%d; kept whole",
                            path, dim, axis, mesh_lib.axis_size(mesh, axis))
            return whole
    return layout


def over_batch(layout, shape):
    """`layout` with its first whole dimension that divides over `batch` split over it
    (unchanged if there is none, or the `batch` axis has one device)."""
    mesh = layout.device_mesh
    batch = mesh_lib.batch_axis(mesh)
    parts = mesh_lib.axis_size(mesh, batch)
    if parts == 1 or batch in layout.axes:
        return layout
    for i, (dim, axis) in enumerate(zip(shape, layout.axes)):
        if axis is None and dim % parts == 0:
            axes = list(layout.axes)
            axes[i] = batch
            return keras.distribution.TensorLayout(axes, mesh)
    return layout


@contextlib.contextmanager
def optimizer_state_over_batch(enabled=True):
    """Within (around `optimizer.build`), optimizer slots are split over the `batch` axis
    too, on top of their weight's layout: ZeRO stage 1, each data-parallel replica keeps
    1/data_parallel of the optimizer state. The step stays exact: the update is
    element-wise, and the new weights are gathered back to their own layout.

    Args:
        enabled: False makes this a no-op (slots sharded exactly like their weight).
    """
    global _state_over_batch
    previous, _state_over_batch = _state_over_batch, enabled
    try:
        yield
    finally:
        _state_over_batch = previous


@contextlib.contextmanager
def weights_over_batch(enabled=True):
    """Within (around building the model and its optimizer), every variable is split over
    the `batch` axis on top of its layout (`over_batch`): ZeRO stage 3, each data-parallel
    replica keeps 1/data_parallel of the weights and, sharded like them, of the optimizer
    state; DTensor gathers a weight where an op needs it whole (see `tfpar.zero.fsdp`).

    Args:
        enabled: False makes this a no-op.
    """
    global _weights_over_batch
    previous, _weights_over_batch = _weights_over_batch, enabled
    try:
        yield
    finally:
        _weights_over_batch = previous


def _initialize(self, value):
    # Keras's TensorFlow `Variable._initialize` while `variable_scope` is on (registry entry
    # `mesh_variables` of tfpar.patches): `self` is the Keras variable being created.
    distribution = keras.distribution.distribution()
    if isinstance(value, tf.Variable) or distribution is None:
        return _original_initialize(self, value)
    initial = value() if callable(value) else value
    initial = tf.convert_to_tensor(initial, dtype=self._dtype)
    if dtensor.is_dtensor(initial):
        # made next to a DVariable (Keras's TensorFlow optimizer colocates a slot with its
        # weight, e.g. when load_model builds it): whole on the host, then laid out
        initial = values.to_host(initial)
    preset = self._layout  # an optimizer slot carries its weight's layout
    self._layout = layout_for(distribution, self.path, initial.shape, preset)
    # A `FullyShardedDataParallel` distribution splits the model's trainable weights
    # (its slots follow by `preset`); its own and the metrics' state stays whole.
    fsdp_weight = (getattr(distribution, "tfpar_weights_over_batch", False)
                   and preset is None and self.trainable)
    if (_state_over_batch and preset is not None) or _weights_over_batch or fsdp_weight:
        self._layout = over_batch(self._layout, initial.shape)
    layout = self._layout.backend_layout
    self._value = dtensor.DVariable(values.to_mesh(initial, layout),
                                    trainable=self.trainable, name=self.name)


def move_to_mesh(keras_variables, distribution):
    """Makes each plain Keras variable a DVariable laid out by `distribution`, holding its
    current value (through the same `_initialize` as a variable created in
    `variable_scope`, registry entry `mesh_variables`): for state made outside the
    distribution that holds no learned value, such as the loss tracker `compile` makes.

    Args:
        keras_variables: Keras variables whose values are plain `tf.Variable`s.
        distribution: a `keras.distribution.ModelParallel` on the target mesh.
    """
    check_target()
    with distribution.scope():
        for variable in keras_variables:
            _initialize(variable, variable.value.read_value())


@contextlib.contextmanager
def variable_scope(distribution):
    """Within, Keras variables are DVariables laid out by `distribution`.

    Build the model and the optimizer (`optimizer.build(model.trainable_variables)`)
    inside the scope.

    Args:
        distribution: a `keras.distribution.ModelParallel` whose `LayoutMap` is on a mesh
            from `make_mesh`.

    Raises:
        TfparError: Keras changed the code this scope hooks.

    Examples:
        >>> with variable_scope(distribution):
        ...     model = models.build("mlp", (32,), 10)
    """
    check_target()
    with patches.variable_initialize_replaced(_initialize):
        with distribution.scope():
            yield


def is_dvariable(variable):
    """Whether a Keras variable (or tf.Variable) is held by a DTensor `DVariable`."""
    inner = variable.value if isinstance(variable, keras.Variable) else variable
    return isinstance(inner, dtensor.DVariable)


def check_dvariables(variables, what="the training step"):
    """Refuses plain variables: each would be updated once per device, silently.

    Args:
        variables: Keras variables or tf.Variables the step reads or writes.
        what: how to name the step in the message.

    Raises:
        TfparError: naming every plain variable and how to fix it.
    """
    plain = [getattr(v, "path", None) or v.name for v in variables if not is_dvariable(v)]
    if plain:
        raise TfparError(
            f"{len(plain)} variable(s) used by {what} are plain tf.Variables, not DTensor "
            f"DVariables: {', '.join(plain[:5])}{', …' if len(plain) > 5 else ''}. A plain "
            "variable is updated once per device (training silently goes wrong); create the "
            "model, its optimizer (optimizer.build) and any extra state inside "
            "tfpar.layout.variable_scope(distribution)")

