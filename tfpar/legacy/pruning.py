"""Magnitude pruning with tfmot during data-parallel training, and the stripped export.

`prune(model, config)` wraps a `tf_keras` model with `prune_low_magnitude` and a
`PolynomialDecay` schedule from the config; `fit` needs the callbacks of
`pruning_callbacks()`. Call both under the strategy scope.

Under a strategy, tfmot re-masks the weights every step with an all-reduce (MEAN) of every
prunable weight, since it cannot know that the replicas' weights and masks are equal. In
synchronous data parallelism they are (same all-reduced update, masks computed from equal
weights), so `prune` makes that step a local `weight * mask` on each replica: the same
values, without a second full-model all-reduce per step beside the gradients' (registry
entry `tfmot_local_mask` of `tfpar.patches`, which subclasses tfmot's private `Pruning`).
"""

import numpy as np
import tensorflow_model_optimization as tfmot
import tf_keras

from tfpar import patches
from tfpar.legacy import options


def schedule(config):
    """The `PolynomialDecay` schedule the config's `prune_*` settings describe."""
    return tfmot.sparsity.keras.PolynomialDecay(
        initial_sparsity=options.option(config, "prune_initial_sparsity"),
        final_sparsity=options.option(config, "prune_sparsity"),
        begin_step=options.option(config, "prune_begin_step"),
        end_step=options.prune_end_step(config),
        frequency=options.option(config, "prune_frequency"))


def prune(model, config):
    """`model` wrapped for magnitude pruning to `config.prune_sparsity`.

    Call under the strategy scope (the wrappers create mask variables) and before
    `compile`.

    Args:
        model: a `tf_keras` model.
        config: a `ParallelConfig` with `prune_*` settings (see `tfpar.legacy.options`).

    Returns:
        the pruning model: every layer tfmot can prune (Dense, Conv2D, ...) wrapped; the
        others (e.g. GroupNormalization, which tfmot refuses) kept as they are.
    """
    plan = schedule(config)

    def wrap(layer):
        if patches.prunable(layer) or isinstance(layer, tfmot.sparsity.keras.PrunableLayer):
            return tfmot.sparsity.keras.prune_low_magnitude(layer, pruning_schedule=plan)
        return layer  # the same layer, weights and all

    pruned = tf_keras.models.clone_model(model, clone_function=wrap)
    for layer in wrappers(pruned):
        patches.local_mask_pruning(layer)
    return pruned


def wrappers(model):
    """The `PruneLowMagnitude` layers of `model`."""
    return patches.prunable_wrappers(model)


def pruning_callbacks():
    """The callbacks `fit` must run with: tfmot's step counter (which also re-masks the
    weights at each epoch end, so the weights are exactly sparse when training stops)."""
    return [tfmot.sparsity.keras.UpdatePruningStep()]


def strip(model, strategy):
    """The plain `tf_keras` model inside a pruning model (after `fit`), with
    weights = weights * mask on every replica.

    Args:
        model: the pruning model.
        strategy: the strategy it was trained under. (Outside its scope tfmot's re-mask
            takes the default replica context for a replica's and fails on mirrored
            variables.)
    """
    with strategy.scope():
        for layer in wrappers(model):
            layer.pruning_obj.weight_mask_op()
    return tfmot.sparsity.keras.strip_pruning(model)


def sparsity_report(model):
    """`{"sparsity": zeros / entries over the prunable weights, "per_weight": {name: …}}` of
    a pruning model (read from its masked weights)."""
    per_weight, zeros, total = {}, 0, 0
    for layer in wrappers(model):
        for weight, _, _ in layer.pruning_vars:
            values = np.asarray(weight.numpy())
            per_weight[weight.name] = float(np.mean(values == 0))
            zeros += int(np.sum(values == 0))
            total += values.size
    return {"sparsity": zeros / total if total else 0.0, "per_weight": per_weight}
