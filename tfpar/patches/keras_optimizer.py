"""Keras 3 optimizers: the private methods tfpar's optimizer mixins override or call, and
how an optimizer the user built gets a mixin (keras 3.15.1 on tensorflow 2.21.0).

- `fused_momentum`: not a replacement but a re-implementation behind a public override.
  `tfpar.optimizers.FusedMomentumMixin.update_step` computes `keras.optimizers.SGD`'s
  momentum update (nesterov=False) with TensorFlow's `ResourceApplyKerasMomentum`
  (`m = m*momentum - lr*g; w += m`) on the slot Keras finds with its private
  `_get_variable_index`; the check looks for that formula and that lookup in
  `SGD.update_step`, and for the kernel in `tf.raw_ops`.
- `optimizer_hooks`: overrides of `TFOptimizer`'s private steps, at the sites `OVERRIDES`
  lists (the internals-boundary test allows exactly those): the aggregating optimizer
  (`tfpar.compression.keras_hook`) replaces `_all_reduce_sum_gradients`, the hook Keras's
  `_backend_update_step` sums gradients with, and re-runs
  `BaseOptimizer._backend_apply_gradients`'s accumulate-or-update choice through
  `replica_cond` (with its accumulators, `_get_variable_index`, `_clip_gradients`);
  `tfpar.nan_guard`, `tfpar.zero` and `tfpar.offload` re-implement `_backend_update_step` around that
  hook. The private methods these mixins call through `self` are listed in `SELF_CALLS`.
  The check compares the overridden and called methods' signatures and looks for the lines
  the overrides re-implement.
- `optimizer_base_build`: not a replacement but a call. A ZeRO optimizer builds only what
  `BaseOptimizer.build` builds (iterations, variable indices), not SGD's or Adam's
  full-size slots: `base_build` is the one caller; the check looks for the base call in
  `SGD.build` and `Adam.build`.
- `stateless_optimizer`: a class swap. The exact DTensor step calls
  `optimizer.stateless_apply`, which Keras's TensorFlow optimizer refuses, and which
  writes through `variable.value.assign` (around a `StatelessScope`); `stateless_class`
  makes a subclass with `BaseOptimizer`'s backend-neutral versions of `STATELESS_METHODS`
  instead of `TFOptimizer`'s. The check compares each method's signature.
- `loss_scale_files`: two methods set on `keras.optimizers.LossScaleOptimizer`, which
  inherits `save_own_variables`/`load_own_variables` from `BaseOptimizer` (they write and
  read `variables`, its own then its inner optimizer's, as one list). Keras's `compile`
  wraps a `tfpar.DistributedOptimizer` in its own class under `mixed_float16`, so no tfpar
  object is there to override them: the methods set here ask tfpar's `save`/`load`
  (`tfpar.keras_codec_state.write_plain`, `read_either`: the inner optimizer's counter of
  skipped steps left out of the file, as stock Keras's class around the plain optimizer
  holds it) and fall back to `BaseOptimizer`'s. The check looks for `variables`' list and
  the loops of `BaseOptimizer`'s two methods, and that the class has no methods of its own
  for them (`loss_scale_files` is the one caller).
- `mix_in` (no target of its own): how tfpar hooks an optimizer the user already built.
"""

import inspect

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.optimizers import base_optimizer as _base_optimizer

from tfpar.patches.versions import WRITTEN_FOR, check_entries

ENTRIES = {
    "fused_momentum": ("keras.optimizers.SGD.update_step (overridden, its formula "
                       "re-implemented by ResourceApplyKerasMomentum)",
                       "tfpar.optimizers.fuse_momentum"),
    "optimizer_hooks": ("TFOptimizer._all_reduce_sum_gradients, _backend_update_step, "
                        "BaseOptimizer._backend_apply_gradients (overridden at the "
                        "OVERRIDES sites)",
                        "tfpar.compression.keras_hook, tfpar.nan_guard, tfpar.zero, "
                        "tfpar.offload"),
    "optimizer_base_build": ("keras.src.optimizers.base_optimizer.BaseOptimizer.build "
                             "(called, not replaced)",
                             "tfpar.zero.sharded.ZeroMixin.build, tfpar.offload"),
    "stateless_optimizer": ("TFOptimizer's overrides of BaseOptimizer methods (the class "
                            "swapped for BaseOptimizer's)",
                            "tfpar.layout.optimizer.stateless_optimizer"),
    "loss_scale_files": ("keras.optimizers.LossScaleOptimizer.save_own_variables and "
                         "load_own_variables (set on the class, BaseOptimizer's inherited)",
                         "tfpar.keras_codec_state.write_plain, read_either "
                         "(tfpar.DistributedOptimizer)"),
}
# (module, class, method) -> entry: the overrides of another library's private method
# tfpar keeps outside this package (checked by the entry; see tests/test_internals_boundary).
OVERRIDES = {
    ("tfpar.compression.keras_hook", "AggregatingOptimizerMixin",
     "_all_reduce_sum_gradients"): "optimizer_hooks",
    ("tfpar.compression.keras_hook", "AggregatingOptimizerMixin",
     "_backend_apply_gradients"): "optimizer_hooks",
    ("tfpar.nan_guard", "SkipNonFiniteMixin", "_backend_update_step"): "optimizer_hooks",
    ("tfpar.zero.sharded", "ZeroMixin", "_backend_update_step"): "optimizer_hooks",
    ("tfpar.offload", "OffloadMixin", "_backend_update_step"): "optimizer_hooks",
}
# (module, class, method) -> entry: private Keras optimizer methods tfpar's optimizer mixins
# call through `self` (reached through the optimizer they are mixed into).
SELF_CALLS = {
    **{("tfpar.compression.keras_hook", "AggregatingOptimizerMixin", name): "optimizer_hooks"
       for name in ("_get_variable_index", "_clip_gradients", "_apply_weight_decay",
                    "_backend_update_step", "_backend_reset_gradient_accumulators",
                    "_backend_increment_gradient_accumulators")},
    ("tfpar.nan_guard", "SkipNonFiniteMixin", "_all_reduce_sum_gradients"): "optimizer_hooks",
    ("tfpar.offload", "OffloadMixin", "_all_reduce_sum_gradients"): "optimizer_hooks",
    ("tfpar.nan_guard", "SkipNonFiniteMixin", "_distributed_tf_update_step"):
        "optimizer_hooks",
    ("tfpar.optimizers", "FusedMomentumMixin", "_get_variable_index"): "fused_momentum",
}
# `fused_momentum`: Keras 3.15.1's SGD.update_step, the lines the fused kernel computes.
_EXPECTED_SGD_UPDATE = (
    "m = self.momentums[self._get_variable_index(variable)]",
    "ops.multiply(m, momentum),\n                    ops.multiply(gradient, learning_rate),",
    "ops.subtract(",
    "self.assign_add(variable, m)",
)
# `stateless_optimizer`: TFOptimizer overrides of BaseOptimizer that go around a
# StatelessScope or through tf.distribute, with BaseOptimizer's signatures (keras 3.15.1).
STATELESS_METHODS = {
    "add_variable_from_reference": "(self, reference_variable, name=None, initializer='zeros')",
    "stateless_apply": "(self, optimizer_variables, grads, trainable_variables)",
    "assign": "(self, variable, value)",
    "assign_add": "(self, variable, value)",
    "assign_sub": "(self, variable, value)",
    "_var_key": "(self, variable)",
    "_apply_weight_decay": "(self, variables)",
    "_backend_update_step": "(self, grads, trainable_variables, learning_rate)",
    "_overwrite_model_variables_with_average_value": "(self, trainable_variables)",
    "_backend_increment_gradient_accumulators": "(self, grads, acc_grads)",
}
_B = _base_optimizer.BaseOptimizer
FRAGMENTS = {
    "optimizer_hooks": [
        ("TFOptimizer._backend_update_step", lambda: TFOptimizer._backend_update_step,
         "grads_and_vars = self._all_reduce_sum_gradients(grads_and_vars)"),
        ("TFOptimizer._backend_update_step", lambda: TFOptimizer._backend_update_step,
         "self._distributed_tf_update_step,\n            self._distribution_strategy,"),
        ("TFOptimizer._distributed_tf_update_step",
         lambda: ("signature", TFOptimizer._distributed_tf_update_step),
         "(self, distribution, grads_and_vars, learning_rate)"),
        ("TFOptimizer._all_reduce_sum_gradients",
         lambda: ("signature", TFOptimizer._all_reduce_sum_gradients),
         "(self, grads_and_vars)"),
        ("TFOptimizer._backend_update_step",
         lambda: ("signature", TFOptimizer._backend_update_step),
         "(self, grads, trainable_variables, learning_rate)"),
        ("BaseOptimizer._backend_apply_gradients",
         lambda: ("signature", _B._backend_apply_gradients), "(self, grads, trainable_variables)"),
        ("BaseOptimizer._trainable_variables", lambda: _B.build,
         "self._trainable_variables = variables[:]"),
    ] + [("BaseOptimizer._backend_apply_gradients", lambda: _B._backend_apply_gradients, f)
         for f in ("self._accumulated_gradients[self._get_variable_index(v)]",
                   "grads = self._clip_gradients(grads)",
                   "self._apply_weight_decay(trainable_variables)",
                   "self._backend_reset_gradient_accumulators()",
                   "self._backend_increment_gradient_accumulators(\n"
                   "                    grads, acc_grads",
                   "is_update_step = (\n                self._iterations + 1")],
    "optimizer_base_build": [
        ("BaseOptimizer.build", lambda: ("signature", _B.build), "(self, variables)"),
        ("SGD.build", lambda: keras.optimizers.SGD.build, "super().build(variables)"),
        ("Adam.build", lambda: keras.optimizers.Adam.build, "super().build(var_list)")],
    "stateless_optimizer": [
        (f"BaseOptimizer.{name}", lambda name=name: ("signature", getattr(_B, name)), expected)
        for name, expected in STATELESS_METHODS.items()],
}


_LSO = keras.optimizers.LossScaleOptimizer
_FILE_METHODS = ("save_own_variables", "load_own_variables")
# `loss_scale_files`: the class's own versions of the two methods at import (none in keras
# 3.15.1: it inherits BaseOptimizer's)
_LSO_OWN_AT_IMPORT = [name for name in _FILE_METHODS if name in vars(_LSO)]
FRAGMENTS["loss_scale_files"] = [
    ("LossScaleOptimizer.variables", lambda: _LSO.variables.fget,
     "return self._variables + self.inner_optimizer.variables"),
    ("BaseOptimizer.save_own_variables", lambda: _B.save_own_variables,
     "for i, variable in enumerate(self.variables):\n            store[str(i)] = "
     "variable.numpy()"),
    ("BaseOptimizer.load_own_variables", lambda: _B.load_own_variables,
     "if len(store.keys()) != len(self.variables):"),
    ("BaseOptimizer.load_own_variables", lambda: _B.load_own_variables,
     "for i, variable in enumerate(self.variables):\n            variable.assign("
     "store[str(i)])"),
]


def loss_scale_files(save, load):
    """Makes `keras.optimizers.LossScaleOptimizer`'s `save_own_variables(store)` call
    `save(optimizer, store)` and its `load_own_variables(store)` call `load(optimizer,
    store)`, each of which returns whether it wrote (read) the entries; when not,
    `BaseOptimizer`'s own method runs, as before. Once (a second call changes nothing).
    Registry entry `loss_scale_files`; raises `TfparError` if its target changed."""
    if getattr(_LSO.save_own_variables, "tfpar_loss_scale_files", False):
        return
    problems = check(["loss_scale_files"])
    if problems:
        from tfpar.errors import TfparError
        raise TfparError("; ".join(problems) + ". Install the pinned versions from "
                         "requirements.txt or update tfpar/patches.")

    def save_own_variables(self, store):
        if not save(self, store):
            _B.save_own_variables(self, store)

    def load_own_variables(self, store):
        if not load(self, store):
            _B.load_own_variables(self, store)

    for method in (save_own_variables, load_own_variables):
        method.tfpar_loss_scale_files = True
        setattr(_LSO, method.__name__, method)


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    problems = []
    if "loss_scale_files" in names and _LSO_OWN_AT_IMPORT:
        problems.append(f"keras {keras.__version__} gave LossScaleOptimizer its own "
                        f"{', '.join(_LSO_OWN_AT_IMPORT)} (registry entry loss_scale_files); "
                        "tfpar.keras_codec_state.write_plain was written for keras "
                        f"{WRITTEN_FOR['keras']}")
    if "fused_momentum" in names:
        source = inspect.getsource(keras.optimizers.SGD.update_step)
        if (not all(f in source for f in _EXPECTED_SGD_UPDATE)
                or not hasattr(tf.raw_ops, "ResourceApplyKerasMomentum")):
            problems.append(f"keras {keras.__version__} changed SGD.update_step (or "
                            f"tensorflow {tf.__version__} lost ResourceApplyKerasMomentum); "
                            "tfpar.optimizers.FusedMomentumMixin was written for keras "
                            f"{WRITTEN_FOR['keras']}")
    problems += check_entries(names, "keras", FRAGMENTS, ENTRIES)
    return problems


def base_build(optimizer, variables):
    """Builds only what every Keras optimizer builds (iterations, learning rate, variable
    indices), none of its own slots. Registry entry `optimizer_base_build`."""
    _B.build(optimizer, variables)


def is_tf_optimizer(optimizer):
    """Whether `optimizer` is a Keras 3 optimizer on the TensorFlow backend (the class whose
    private steps `optimizer_hooks` overrides)."""
    return isinstance(optimizer, TFOptimizer)


def built_variables(optimizer):
    """The variables a built Keras optimizer was built for. Registry entry
    `optimizer_hooks`."""
    return optimizer._trainable_variables


def is_base_optimizer(optimizer):
    """Whether `optimizer` comes from Keras's backend-neutral optimizer base."""
    return isinstance(optimizer, _B)


_STATELESS = {}


def stateless_class(cls):
    """A subclass of the Keras optimizer class `cls` (same name and module) that uses
    `BaseOptimizer`'s versions of `STATELESS_METHODS` where `cls` uses `TFOptimizer`'s (a
    class's own override, a `LossScaleOptimizer`'s `stateless_apply`, is kept); cached.
    Registry entry `stateless_optimizer`."""
    if cls in _STATELESS.values():
        return cls
    if cls not in _STATELESS:
        methods = {m: _B.__dict__[m] for m in STATELESS_METHODS
                   if getattr(cls, m) is getattr(TFOptimizer, m, None)}
        methods["__module__"] = cls.__module__
        _STATELESS[cls] = type(cls.__name__, (cls,), methods)
    return _STATELESS[cls]


def to_stateless(optimizer):
    """Makes `optimizer`'s class its `stateless_class`, in place. Registry entry
    `stateless_optimizer`."""
    optimizer.__class__ = stateless_class(type(optimizer))
    return optimizer


def is_stateless_class(cls):
    """Whether `cls` was made by `stateless_class`, or is such a class with a mixin put in
    front of it since (`mix_in`: `tfpar.layout.optimizer.applies_steps`)."""
    return any(c in _STATELESS.values() for c in cls.__mro__)


_MIXED = {}


def mix_in(obj, mixin):
    """Makes `obj` an instance of a subclass of its class with `mixin` in front, in place
    (once; the subclass is cached). The subclass keeps the original's name and module, so
    `get_config` and saving see the original class: how tfpar hooks an optimizer the user
    already built without changing what gets saved."""
    cls = type(obj)
    if isinstance(obj, mixin):
        return obj
    if (cls, mixin) not in _MIXED:
        _MIXED[cls, mixin] = type(cls.__name__, (mixin, cls),
                                  {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    obj.__class__ = _MIXED[cls, mixin]
    return obj


def unmixed_class(cls, mixins):
    """The class `mix_in` mixed every class of `mixins` in front of to make `cls` (`cls`
    itself if none)."""
    while issubclass(cls, mixins):
        cls = cls.__bases__[-1]  # `mix_in`'s classes: (mixin, the class mixed)
    return cls


def mix_out(obj, mixins):
    """Undoes `mix_in` for every class of `mixins` in front of `obj`'s class, in place:
    `obj` is again an instance of the class those were mixed into."""
    obj.__class__ = unmixed_class(type(obj), mixins)
    return obj
