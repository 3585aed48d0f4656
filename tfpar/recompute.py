"""Activation recomputation (`--recompute`) applied from outside the model zoo.

Models in `tfpar.models` are plain Keras; recomputation is chosen when they are built,
through Keras's public `keras.RematScope` (on TensorFlow it is `tf.recompute_grad`):

- `"none"`: every activation is kept for the backward pass.
- `"blocks"`: each block keeps only its input and recomputes its inside in the backward:
  the transformer's `block_i` (attention + MLP), the MLP's hidden `dense_i` layers, the
  convnet's `block_i_*` convolutions and norms.
- `"full"`: pipelines only (refused on data parallelism by `tfpar.compat`): each stage's
  whole forward is recomputed. (Recomputing every layer through Keras's `RematScope`
  fails: layers called with keyword arguments, e.g. Dense's `training=`, are refused by
  `tf.recompute_grad` in graph mode.)

On a pipeline (`pipeline_stages > 1`), `"full"` recomputes each stage's forward in its
backward (`PipelineModel(recompute=True)`, keeping one input per stage and micro-batch) and
`"blocks"` recomputes blocks inside the stages as above.

Recomputation changes no number: the same ops run on the same inputs.
"""

import contextlib
import inspect

import keras

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


def scope(config):
    """The context to build `config.model` in so that it recomputes as `config.recompute`
    says (a no-op for `"none"`, and for `"full"` on pipelines, which recompute per stage)."""
    mode = config.recompute
    if mode == "none" or (mode == "full" and config.pipeline_stages > 1):
        return contextlib.nullcontext()
    return keras.RematScope(mode="list_of_layers",
                            layer_names=block_names(config.model, config.model_depth))
