"""Activation recomputation (`--recompute`) applied from outside the model zoo.

Models in `tfpar.models` are plain Keras; recomputation is applied to a built model by
`apply(model, config)`, which makes chosen layers keep only their inputs and run their
forward again in the backward pass (`tf.recompute_grad`):

- `"none"`: every activation is kept for the backward pass.
- `"blocks"`: the zoo's blocks are recomputed: the transformer's `block_i` (attention +
  MLP), the MLP's hidden `dense_i` layers, the convnet's `block_i_*` convolutions and
  norms.
- `"full"`: every top-level layer of the model is recomputed (embeddings, blocks, final
  norm and head alike), so any functional model recomputes, whatever its layer names.
  On a pipeline (`pipeline_stages > 1`) `"full"` instead recomputes each stage's whole
  forward in its backward (`PipelineModel(recompute=True)`, one input kept per stage and
  micro-batch).

A recomputed layer's weights enter `tf.recompute_grad` as explicit inputs (the layer runs
inside a `keras.StatelessScope` mapping its weights to them). That is what lets the same
wrapper run on `tf.distribute` replicas, where weights are variables, and inside the
DTensor mesh step (`tfpar.layout.step`), where the whole forward is stateless and weights
are tensors that `tf.recompute_grad` would not differentiate if they were only captured.
Keyword arguments of the call (`training=`, masks) are bound before `tf.recompute_grad`,
which refuses them in graph mode: the failure of Keras's own `RematScope(mode="full")`.

Layers holding non-trainable state (batch-norm statistics, dropout seeds) are not
recomputed: their state updates would run twice. None of the zoo's models has such
layers.

Recomputation changes no number: the same ops run on the same inputs.
"""

import functools
import inspect

import keras
import tensorflow as tf

from tfpar import patches

MODES = ("none", "blocks", "full")

# The zoo's block names (stable, see tfpar/models): transformer, mlp, convnet.
_BLOCK_PATTERNS = ("block_{i}", "dense_{i}", "block_{i}_conv1", "block_{i}_conv2",
                   "block_{i}_norm1", "block_{i}_norm2")


def block_names(model_name, depth=0):
    """Names of the layers `"blocks"` recomputes in zoo model `model_name` of `depth`
    blocks (0 = the model's default depth)."""
    from tfpar import models
    if not depth:
        depth = inspect.signature(models.BUILDERS[model_name]).parameters["depth"].default
    return [p.format(i=i) for i in range(depth) for p in _BLOCK_PATTERNS]


def recomputed_layers(model, mode, names=()):
    """The top-level layers of `model` that `mode` recomputes (`names`: the block names
    for `"blocks"`)."""
    if mode == "none":
        return []
    chosen = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer) or not layer.trainable_weights:
            continue  # nothing to save: no weights means no activation worth a recompute
        if layer.non_trainable_weights:
            continue  # state updates would run twice
        if mode == "full" or layer.name in names:
            chosen.append(layer)
    return chosen


def apply(model, config):
    """Makes `model` (a built zoo model) recompute as `config.recompute` says; returns the
    names of the layers recomputed. A no-op for `"none"`, and for `"full"` on a pipeline,
    which recomputes per stage (`tfpar.pipeline`)."""
    mode = config.recompute
    if mode == "none" or (mode == "full" and config.dims.pp_enabled):
        return []
    layers = recomputed_layers(model, mode, block_names(config.model, config.model_depth))
    for layer in layers:
        rematerialize(layer)
    return [layer.name for layer in layers]


def every_layer(model):
    """Recomputes every top-level layer of `model` (`"full"` on any functional model, a
    user's own included); returns `model`.

    >>> model = every_layer(tfpar.models.build("mlp", (8,), 4))
    """
    for layer in recomputed_layers(model, "full"):
        rematerialize(layer)
    return model


def rematerialize(layer):
    """Makes `layer` keep only its inputs and recompute its forward in the backward pass.

    Replaces the layer's `call` on the instance (the class is untouched); calling it twice
    is a no-op.
    """
    if getattr(layer, "_tfpar_recomputed", False):
        return
    call = layer.call

    @functools.wraps(call)
    def recomputed_call(*args, **kwargs):
        variables = list(layer.trainable_variables)
        # The values the layer would read now (under the mesh step's StatelessScope: its
        # tensors), in the variables' own dtype (undoing a mixed-precision autocast, which
        # the inner call applies again: cast(cast(w)) is exact).
        weights = [tf.cast(v.value, v.dtype) for v in variables]
        flat = tf.nest.flatten(args)
        positions = [i for i, a in enumerate(flat) if tf.is_tensor(a)]
        tensors = [flat[i] for i in positions]
        autocast = patches.autocast_scope()  # mixed precision: replayed in the backward

        def forward(*inputs):
            values = list(flat)
            for i, tensor in zip(positions, inputs[:len(positions)]):
                values[i] = tensor
            mapping = list(zip(variables, inputs[len(positions):]))
            with keras.StatelessScope(state_mapping=mapping), patches.autocasting(autocast):
                return call(*tf.nest.pack_sequence_as(args, values), **kwargs)

        return tf.recompute_grad(forward)(*tensors, *weights)

    object.__setattr__(layer, "call", recomputed_call)
    object.__setattr__(layer, "_tfpar_recomputed", True)
