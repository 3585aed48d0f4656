"""tensorflow-model-optimization's private modules that `tfpar.legacy`'s pruning and
quantization-aware training reach (tensorflow-model-optimization 0.8.1 on tf_keras 2.21.0).

- `tfmot_local_mask`: a subclass and a class swap. Under a strategy, tfmot re-masks the
  weights every step (`Pruning._weight_assign_objs`) with an all-reduce (MEAN) of every
  prunable weight, since it cannot know that the replicas' weights and masks are equal.
  In synchronous data parallelism they are, so `local_mask_pruning` makes each wrapper's
  `pruning_obj` a `LocalMaskPruning` (`local_mask_class`), whose re-mask is a local
  `weight * mask` on each replica (the same values, without a second full-model
  all-reduce per step). The check
  compares `_weight_assign_objs`' signature and looks for the `_pruning_vars` it reads.
- `tfmot_registry`: calls. Which layers tfmot can prune (`PruneRegistry.supports`,
  `prunable`) and the pruning wrappers of a model (`collect_prunable_layers`,
  `prunable_wrappers`), which tfmot's public API does not export; the check compares
  their signatures.
- `tfmot_quantize_layer`: a read. The model's input quantizer sits in tfmot's private
  `QuantizeLayer` (`input_quantizers` finds them); the check compares its signature.

tfmot (and with it tf_keras) is imported on first use, not with `tfpar.patches`.
"""

import functools
import importlib

import tensorflow as tf

from tfpar.patches.versions import check_entries

ENTRIES = {
    "tfmot_local_mask": ("tensorflow_model_optimization...sparsity.keras.pruning_impl."
                         "Pruning._weight_assign_objs (overridden by LocalMaskPruning)",
                         "tfpar.legacy.pruning.prune"),
    "tfmot_registry": ("tensorflow_model_optimization...sparsity.keras.prune_registry."
                       "PruneRegistry.supports, pruning_wrapper.collect_prunable_layers "
                       "(called, not replaced)", "tfpar.legacy.pruning"),
    "tfmot_quantize_layer": ("tensorflow_model_optimization...quantization.keras."
                             "quantize_layer.QuantizeLayer (read, not replaced)",
                             "tfpar.legacy.quantization.quantize"),
}
FRAGMENTS = {
    "tfmot_local_mask": [
        ("Pruning._weight_assign_objs",
         lambda: ("signature", _pimpl().Pruning._weight_assign_objs), "(self)"),
        ("Pruning._weight_assign_objs", lambda: _pimpl().Pruning._weight_assign_objs,
         "for weight, mask, _ in self._pruning_vars:"),
        ("Pruning.weight_mask_op", lambda: _pimpl().Pruning.weight_mask_op,
         "return tf.group(self._weight_assign_objs())")],
    "tfmot_registry": [
        ("PruneRegistry.supports", lambda: ("signature", _preg().PruneRegistry.supports),
         "(layer)"),
        ("pruning_wrapper.collect_prunable_layers",
         lambda: ("signature", _pwrap().collect_prunable_layers), "(model)")],
    "tfmot_quantize_layer": [
        ("QuantizeLayer", lambda: ("signature", _qlayer().QuantizeLayer.__init__),
         "(self, quantizer, **kwargs)")],
}
_NONE = tf.VariableAggregation.NONE
_PRIVATE = "tensorflow_model_optimization.python.core."


def _tfmot(module):
    """tfmot's private module `module` (under `tensorflow_model_optimization.python.core`)."""
    return importlib.import_module(_PRIVATE + module)


def _pimpl():
    return _tfmot("sparsity.keras.pruning_impl")


def _preg():
    return _tfmot("sparsity.keras.prune_registry")


def _pwrap():
    return _tfmot("sparsity.keras.pruning_wrapper")


def _qlayer():
    return _tfmot("quantization.keras.quantize_layer")


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    problems = []
    problems += check_entries(names, "tensorflow_model_optimization", FRAGMENTS, ENTRIES)
    return problems


@functools.cache
def local_mask_class():
    """`LocalMaskPruning`: tfmot's `Pruning` whose per-step `weight <- weight * mask` stays
    on each replica. Registry entry `tfmot_local_mask`."""

    class LocalMaskPruning(_pimpl().Pruning):
        def _weight_assign_objs(self):
            if (not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context()
                    or any(w.aggregation != _NONE for w, _, _ in self._pruning_vars)):
                return super()._weight_assign_objs()
            # A NONE-aggregated mirrored variable updated in replica context writes only
            # this replica's copy; every replica writes the same value.
            return [w.assign(tf.cast(w * m, w.dtype)) for w, m, _ in self._pruning_vars]

    return LocalMaskPruning


def local_mask_pruning(wrapper):
    """Makes a `PruneLowMagnitude` wrapper re-mask on each replica locally, in place.
    Registry entry `tfmot_local_mask`."""
    wrapper.pruning_obj.__class__ = local_mask_class()
    return wrapper


def prunable(layer):
    """Whether tfmot's registry can prune `layer`. Registry entry `tfmot_registry`."""
    return _preg().PruneRegistry.supports(layer)


def prunable_wrappers(model):
    """The `PruneLowMagnitude` layers of `model`. Registry entry `tfmot_registry`."""
    return _pwrap().collect_prunable_layers(model)


def input_quantizers(model):
    """The quantizers of `model`'s `QuantizeLayer`s (the quantization of its inputs), as
    `(layer, quantizer)`. Registry entry `tfmot_quantize_layer`."""
    return [(layer, layer.quantizer) for layer in model.layers
            if isinstance(layer, _qlayer().QuantizeLayer)]
