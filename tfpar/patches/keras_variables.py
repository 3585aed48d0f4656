"""Keras variables held by DTensor DVariables: reading and writing their values from the
host (keras 3.15.1 on tensorflow 2.21.0).

- `mesh_variable_values`: Keras's TensorFlow `Variable.numpy`, `__array__` (inherited from
  the backend-neutral `KerasVariable`) and `_direct_assign` (what `assign`, `set_weights`,
  `load_weights` and `load_model` end in) copy a sharded DTensor to the host, or write a
  regular tensor into a DVariable, both of which DTensor refuses ("Trying to copy a
  non-single-device and non-replicated DTensor", "AssignVariableOp got a regular
  tensor"). After `tfpar.layout.enable()` they are replaced (`set_variable_values`) by
  versions that hand a variable whose storage is a DVariable to
  `tfpar.layout.keras_state` (gathered to the host; laid out by the variable's layout, as
  Keras's JAX backend's `_direct_assign` does with `distribute_tensor`) and every other
  variable to Keras's own code. The check looks for the lines they stand in for.
- `autocast_scope`: Keras's mixed-precision cast of a layer's float variables to its
  compute dtype is a global `AutocastScope` that `Layer.__call__` enters. A layer's
  forward replayed by `tf.recompute_grad` in the backward pass runs outside that call, so
  `tfpar.zero.fsdp` and `tfpar.recompute` read the scope when the layer runs
  (`autocast_scope`) and enter one of its dtype in the replay (`autocasting`).
- `stateless_accesses`: inside a `keras.StatelessScope` a Keras variable asks the scope
  for its value on every read (`value`) and hands it every write (`assign`, which
  `assign_add` and a metric's `update_state` end in); the scope keeps only the written
  variable's id. `AccessScope` is a `StatelessScope` that also keeps each variable read or
  written in it, by object, in order: what a pipeline stage's traced forward touched
  (`tfpar.layout.keras_pipeline`). The check looks for those two calls.
"""

import contextlib

import keras
from keras.src.backend.common import variables as _common_variables
from keras.src.backend.tensorflow import core as _tf_core

from tfpar.patches.versions import check_entries

ENTRIES = {
    "mesh_variable_values": ("keras.src.backend.tensorflow.core.Variable.numpy, __array__, "
                             "_direct_assign (replaced while enabled)",
                             "tfpar.layout.keras_state, tfpar.layout.enable"),
    "autocast_scope": ("keras.src.backend.common.variables.get_autocast_scope, "
                       "AutocastScope (read, entered)", "tfpar.zero.fsdp, tfpar.recompute"),
    "stateless_accesses": ("keras.src.backend.common.stateless_scope.StatelessScope."
                           "get_current_value, add_update (overridden by AccessScope)",
                           "tfpar.layout.keras_pipeline"),
}
# Keras's own, before any patch: what `set_variable_values(None)` puts back.
NUMPY = _tf_core.Variable.__dict__["numpy"]
DIRECT_ASSIGN = _tf_core.Variable.__dict__["_direct_assign"]
FRAGMENTS = {
    "mesh_variable_values": [
        ("tensorflow Variable.numpy", lambda: NUMPY, "return self.value.numpy()"),
        ("tensorflow Variable._direct_assign", lambda: DIRECT_ASSIGN,
         "self._value.assign(tf.cast(value, self._value.dtype))"),
        ("KerasVariable.__array__", lambda: _common_variables.Variable.__array__,
         "return np.asarray(self.value.__array__(dtype))"),
        ("KerasVariable.numpy", lambda: _common_variables.Variable.numpy,
         "return np.array(self)"),
        ("KerasVariable.assign", lambda: _common_variables.Variable.assign,
         "self._direct_assign(value)"),
    ],
    "autocast_scope": [
        ("KerasVariable._maybe_autocast", lambda: _common_variables.Variable._maybe_autocast,
         "autocast_scope = get_autocast_scope()"),
        ("AutocastScope.__enter__", lambda: _common_variables.AutocastScope.__enter__,
         'global_state.set_global_attribute("autocast_scope", self)'),
    ],
    "stateless_accesses": [
        ("KerasVariable.value", lambda: _common_variables.Variable.value.fget,
         "value = scope.get_current_value(self)"),
        ("KerasVariable.assign", lambda: _common_variables.Variable.assign,
         "scope.add_update((self, value))"),
        ("StatelessScope.add_update", lambda: keras.StatelessScope.add_update,
         "variable, value = update"),
        ("StatelessScope.get_current_value", lambda: keras.StatelessScope.get_current_value,
         "return self.state_mapping.get(id(variable), None)"),
    ],
}


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    problems = check_entries(names, "keras", FRAGMENTS, ENTRIES)
    own = vars(_tf_core.Variable).get("__array__")
    if ("mesh_variable_values" in names and own is not None
            and not getattr(own, "__module__", "").startswith("tfpar.")):
        problems.append(f"keras {keras.__version__} gave its TensorFlow Variable its own "
                        "__array__ (registry entry mesh_variable_values); "
                        "tfpar.layout.keras_state would replace it")
    return problems


def set_variable_values(numpy, array, direct_assign):
    """Makes Keras's TensorFlow `Variable.numpy`, `__array__` and `_direct_assign` these
    functions; `set_variable_values(None, None, None)` puts Keras's own back. Registry entry
    `mesh_variable_values`."""
    cls = _tf_core.Variable
    if numpy is None:
        cls.numpy, cls._direct_assign = NUMPY, DIRECT_ASSIGN
        if "__array__" in vars(cls):
            del cls.__array__
        return
    cls.numpy, cls.__array__, cls._direct_assign = numpy, array, direct_assign


def keras_numpy(variable):
    """Keras's own `variable.numpy()` (for a variable not on a mesh)."""
    return NUMPY(variable)


def keras_array(variable, dtype=None):
    """Keras's own `np.asarray(variable)` (for a variable not on a mesh)."""
    return _common_variables.Variable.__array__(variable, dtype)


def keras_direct_assign(variable, value):
    """Keras's own write of an already converted `value` into `variable`."""
    DIRECT_ASSIGN(variable, value)



def autocast_scope():
    """The dtype Keras casts float variables to now (a layer's compute dtype under mixed
    precision), or None. Registry entry `autocast_scope`."""
    scope = _common_variables.get_autocast_scope()
    return None if scope is None else scope.dtype


@contextlib.contextmanager
def autocasting(dtype):
    """Within, Keras casts float variables to `dtype` (None: a no-op), as inside the
    `Layer.__call__` that read it with `autocast_scope`. Registry entry `autocast_scope`."""
    if dtype is None:
        yield
        return
    with _common_variables.AutocastScope(dtype):
        yield


class AccessScope(keras.StatelessScope):
    """A `keras.StatelessScope` that also keeps each Keras variable read (`read`) or
    written (`written`) inside it: `{id: variable}`, in the order first touched. Registry
    entry `stateless_accesses`."""

    def __init__(self, state_mapping=None, **kwargs):
        super().__init__(state_mapping=state_mapping, **kwargs)
        self.read, self.written = {}, {}

    def get_current_value(self, variable):
        self.read.setdefault(id(variable), variable)
        return super().get_current_value(variable)

    def add_update(self, update):
        self.written.setdefault(id(update[0]), update[0])
        super().add_update(update)
