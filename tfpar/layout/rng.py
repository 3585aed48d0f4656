"""Random draws on a mesh equal to one device's: dropout masks and noise.

Keras draws with TensorFlow's stateless random ops (`stateless_dropout`,
`stateless_uniform`, ...). DTensor expands such an op shard by shard and, for a sharded
output, changes the seed on each shard (so that shards do not repeat each other). Measured
on TF 2.21: `stateless_dropout` of a (16, 200) batch split over a 2 × 4 mesh kept other
units than one device with the same seed, and keras.io's guide model (`Dropout(0.4)`) ended
its 24 steps up to 2.8e-2 away from the single-device weights (4.5e-8 without dropout).
Drawn whole (replicated), the op gives one device's numbers on every device, and each
device keeps its own slice of them (a local slice, no communication).

While a mesh step is traced (`drawing_whole`), Keras's TensorFlow `random.dropout`,
`uniform`, `normal` and `truncated_normal` (registry entry `mesh_random` of
`tfpar.patches`) are wrappers that draw the whole tensor; outside a mesh step they are
Keras's own. The cost: every device draws the random numbers of the whole batch.
"""

import contextlib
import threading

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import patches

_state = threading.local()
_installed = False


@contextlib.contextmanager
def drawing_whole(mesh):
    """Within (around tracing a step on `mesh`, a DTensor mesh), Keras's random draws
    give one device's numbers on every device of `mesh`."""
    _install()
    previous = getattr(_state, "mesh", None)
    _state.mesh = mesh
    try:
        yield
    finally:
        _state.mesh = previous


def _install():
    global _installed
    if not _installed:
        for name, wrapper in _WRAPPERS.items():
            patches.set_backend_random(name, wrapper)
        _installed = True


def _whole(value):
    mesh = getattr(_state, "mesh", None)
    return dtensor.relayout(value, dtensor.Layout.replicated(mesh, value.shape.rank))


def _drawing(name):
    keras_fn = patches.BACKEND_RANDOM[name]

    def draw(*args, **kwargs):
        value = keras_fn(*args, **kwargs)
        return value if getattr(_state, "mesh", None) is None else _whole(value)

    draw.__name__ = name
    return draw


def _dropout(inputs, rate, noise_shape=None, seed=None):
    keras_dropout = patches.BACKEND_RANDOM["dropout"]
    if getattr(_state, "mesh", None) is None or rate in (0.0, 1.0):
        return keras_dropout(inputs, rate, noise_shape=noise_shape, seed=seed)
    shape = tf.shape(inputs)
    if noise_shape is not None:
        shape = [shape[i] if dim is None else dim for i, dim in enumerate(noise_shape)]
    # Keras's own dropout of ones: the same draw (shape and seed) as on `inputs`, giving
    # 1/(1 - rate) where a unit is kept and 0 where it is dropped.
    scale = _whole(keras_dropout(tf.ones(shape, inputs.dtype), rate, seed=seed))
    if noise_shape is None:
        scale = dtensor.relayout_like(scale, inputs)  # each device's own slice
    return inputs * scale


_WRAPPERS = {"dropout": _dropout, **{name: _drawing(name) for name in
                                     ("uniform", "normal", "truncated_normal")}}
