"""Model profiles for the planner: parameters, FLOPs, activation sizes, how it can be cut.

Parameters and weight-matrix shapes are read off the built Keras model (exact); FLOPs and
activation sizes follow from each layer's kind and the tokens (sequence positions or
pixels) it runs over.
"""

import math

from tfpar.compression import powersgd
from tfpar.plan.cost import Profile

FLOAT = 4  # bytes


def profile_model(model, name, tokens_of=lambda path: 1, attention=None, blocks=None,
                  tp_syncs_per_block=0, max_tensor_parallel=1):
    """A `Profile` of a built Keras model.

    Args:
        model: the Keras model.
        name: its name in tables.
        tokens_of: `weight path -> positions the weight is applied at` (1 for dense layers
            on vectors, the sequence length for transformer projections, H·W for convs).
        attention: `(layers, seq_len, width, heads)` to add attention-score FLOPs/memory.
        blocks: how many pipeline stages it can be cut into (default: top-level layers
            with weights).
    """
    flops, activations, shapes = 0.0, 0.0, []
    for w in model.trainable_weights:
        if len(w.shape) < 2:
            continue
        shapes.append(powersgd.matrix_shape(w.shape))  # the view PowerSGD compresses
        rows, cols = math.prod(w.shape[:-1]), w.shape[-1]
        if "embeddings" in w.path:
            activations += FLOAT * tokens_of(w.path) * cols
            continue
        positions = tokens_of(w.path)
        flops += 2 * rows * cols * positions
        activations += 2 * FLOAT * positions * cols  # output and its activation/residual
    boundary = 0.0
    if attention is not None:
        layers, seq, width, heads = attention
        flops += layers * 4 * seq * seq * width
        activations += layers * FLOAT * heads * seq * seq
        boundary = FLOAT * seq * width
    if blocks is None:
        blocks = sum(1 for layer in model.layers if layer.trainable_weights)
    if not boundary:
        boundary = FLOAT * max(cols for _, cols in shapes)
    return Profile(name=name, params=int(sum(math.prod(w.shape) for w in model.trainable_weights)),
                   flops_per_example=flops, activation_bytes_per_example=activations,
                   boundary_bytes_per_example=boundary, blocks=blocks,
                   tp_syncs_per_block=tp_syncs_per_block,
                   max_tensor_parallel=max_tensor_parallel, matrix_shapes=tuple(shapes))


def profile_builtin(name, width=0, depth=0):
    """The profile of `tfpar.models` NAME at its default size (or `width`/`depth`) on its task."""
    from tfpar import models
    from tfpar import data

    task = data.DEFAULT_TASKS[name](0)
    model = models.build(name, task.input_shape, task.num_classes, width=width, depth=depth)
    if name == "transformer":
        seq = task.input_shape[0]
        block = model.get_layer("block_0")
        return profile_model(
            model, name, tokens_of=lambda path: seq,
            attention=(sum(1 for l in model.layers if l.name.startswith("block_")), seq,
                       block.width, block.heads),
            # Megatron: one all-reduce after attention and one after the MLP, forward and
            # backward.
            tp_syncs_per_block=4, max_tensor_parallel=block.heads)
    if name == "convnet":
        pixels = task.input_shape[0] * task.input_shape[1]
        return profile_model(model, name,
                             tokens_of=lambda path: 1 if path.startswith("logits") else pixels)
    # MLP: Megatron pairs (column then row split) need one all-reduce per pair each way.
    width = model.get_layer("dense_0").units
    return profile_model(model, name, tp_syncs_per_block=1,
                         max_tensor_parallel=max(d for d in (1, 2, 4, 8) if width % d == 0))
