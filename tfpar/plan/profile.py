"""Model profiles for the planner, from shapes alone: nothing is allocated.

The built-in models are profiled by formula (`transformer_profile`, `mlp_profile`,
`convnet_profile`), without importing TensorFlow, so a trillion-parameter transformer
is profiled in microseconds. `gpt_profile` is the same transformer as Megatron-LM builds
it (tied head, dropout). A user's own Keras model is traced symbolically by
`tfpar.plan.symbolic` (weights deferred, never created); `tests/test_plan_profile.py`
checks the formulas against that trace of the real built-in models.

Activation counts (elements per example and block, without dropout) follow Korthikanti
et al. 2022, "Reducing Activation Recomputation in Large Transformer Models": a pre-norm
block keeps 16·s·h + a·s² elements for its backward (layer-norm inputs 2sh, the
query/key/value input sh, Q and K 2sh, V sh, the softmax a·s², the attention output sh,
the MLP input sh, the 4h pre- and post-GELU 8sh); 4sh of them (layer-norm inputs, and
the inputs of the two column-parallel projections) are whole on every tensor-parallel
device. Dropout adds a one-byte mask per attention score and per block output twice and
keeps the dropped scores (Megatron-LM's 34·s·h + 5·a·s² bytes at 2-byte elements).
"""

import math

from tfpar.plan.cost import Profile

# What `python -m tfpar.train` builds for each model on its generated task: the task's
# input shape and classes (`tfpar.data.DEFAULT_TASKS`) and the model's default size
# (`models/`). tests/test_plan_profile.py checks both against the code.
BUILTIN = {
    "mlp": {"input_shape": (32,), "classes": 10, "width": 256, "depth": 2},
    "convnet": {"input_shape": (16, 16, 3), "classes": 10, "width": 32, "depth": 2},
    "transformer": {"input_shape": (16,), "classes": 17, "width": 64, "depth": 2,
                    "heads": 4},
}


def transformer_profile(width, depth, heads, seq_len, vocab, tied_head=False,
                        dropout=False, element_bytes=4, name="transformer"):
    """A GPT-style decoder: token + position embedding, `depth` pre-norm blocks (attention
    with biases, 4x GELU MLP), a final norm and a head over the vocabulary.

    Args:
        width, depth, heads, seq_len, vocab: h, l, a, s, V.
        tied_head: the head reuses the token embedding (Megatron-LM; no head bias);
            otherwise a Dense with bias (`models/transformer`).
        dropout: count Megatron-LM's dropout masks and kept scores.
        element_bytes: bytes of one activation element (2 with mixed precision).

    Returns:
        A `cost.Profile`.
    """
    h, s, a, V = width, seq_len, heads, vocab
    block = 12 * h * h + 13 * h
    embed = V * h + s * h
    head = V * h + (0 if tied_head else V)
    params = embed + depth * block + 2 * h + (0 if tied_head else head)
    block_flops = 2 * s * 12 * h * h + 4 * s * s * h  # projections + QK^T and AV
    head_flops = 2 * s * h * V
    elements = 16 * s * h + a * s * s
    per_block = element_bytes * elements
    if dropout:
        per_block += element_bytes * a * s * s + (a * s * s + 2 * s * h)
    replicated = element_bytes * 4 * s * h
    shapes = [(h, h)] * 4 * depth + [(h, 4 * h), (4 * h, h)] * depth + [(V, h), (s, h)]
    if not tied_head:
        shapes.append((h, V))
    return Profile(
        name=name, params=params, flops_per_example=depth * block_flops + head_flops,
        activation_bytes_per_example=depth * per_block,
        boundary_bytes_per_example=element_bytes * s * h, blocks=depth,
        tp_syncs_per_block=2,  # Megatron: one all-reduce after attention, one after the MLP
        max_tensor_parallel=heads, matrix_shapes=tuple(shapes),
        first_params=embed, last_params=2 * h + head, last_flops_per_example=head_flops,
        replicated_activation_fraction=replicated / per_block, block_params=depth * block)


def gpt_profile(layers, hidden, heads, seq_len=2048, vocab=51200, element_bytes=2):
    """The GPT of Megatron-LM (Narayanan et al. 2021): tied head, dropout, mixed
    precision. `gpt_profile(48, 8192, 64).params` is 39.1 billion."""
    return transformer_profile(hidden, layers, heads, seq_len, vocab, tied_head=True,
                               dropout=True, element_bytes=element_bytes,
                               name=f"gpt-{layers}x{hidden}")


def mlp_profile(width, depth, inputs, classes, element_bytes=4, name="mlp"):
    """`models/mlp`: `depth` ReLU Dense layers of `width`, then logits. Tensor parallelism
    splits Dense pairs (one all-reduce per pair); a pipeline cuts between layers."""
    dims = [inputs] + [width] * depth + [classes]
    params = sum(i * o + o for i, o in zip(dims, dims[1:]))
    flops = sum(2 * i * o for i, o in zip(dims, dims[1:]))
    # Each Dense keeps its input; ReLU's gradient reads its output (the next input), not
    # its pre-activation; the loss reads the logits.
    elements = inputs + width * depth + classes
    return Profile(
        name=name, params=params, flops_per_example=flops,
        activation_bytes_per_example=element_bytes * elements,
        boundary_bytes_per_example=element_bytes * width, blocks=depth + 1,
        tp_syncs_per_block=0.5, max_tensor_parallel=width,
        matrix_shapes=tuple(zip(dims, dims[1:])))


def convnet_profile(width, depth, image_shape, classes, element_bytes=4, name="convnet"):
    """`models/convnet`: a 3×3 conv stem, `depth` residual blocks of two 3×3 convs (group
    norm, ReLU), global pooling, logits. A pipeline cuts only between blocks (a residual
    branch stays whole); no tensor-parallel preset."""
    H, W, C = image_shape
    pixels = H * W
    conv = 9 * width * width + width
    params = (9 * C * width + width + 2 * width + depth * 2 * (conv + 2 * width)
              + width * classes + classes)
    flops = 2 * pixels * (9 * C * width + depth * 2 * 9 * width * width) + \
        2 * width * classes
    # Group norm reads its input (the conv output), a conv its input (a ReLU output, which
    # ReLU's gradient reads too): stem 2, each block 4 feature maps.
    elements = pixels * C + pixels * width * (2 + 4 * depth) + width + classes
    return Profile(
        name=name, params=params, flops_per_example=flops,
        activation_bytes_per_example=element_bytes * elements,
        boundary_bytes_per_example=element_bytes * pixels * width, blocks=depth + 2,
        matrix_shapes=tuple([(9 * C, width)] + [(9 * width, width)] * 2 * depth
                            + [(width, classes)]))


def builtin_profile(name, width=0, depth=0, heads=0, seq_len=0, vocab=0, element_bytes=4):
    """The profile of what `python -m tfpar.train --model=NAME` trains (its generated task,
    `--model_width`/`--model_depth`; 0 keeps the default). For the transformer, `heads`,
    `seq_len` and `vocab` plan other shapes than the trainer's (0: the trainer's)."""
    spec = BUILTIN[name]
    width, depth = width or spec["width"], depth or spec["depth"]
    if name == "transformer":
        return transformer_profile(width, depth, heads or spec["heads"],
                                   seq_len or spec["input_shape"][0],
                                   vocab or spec["classes"], element_bytes=element_bytes)
    if name == "mlp":
        return mlp_profile(width, depth, math.prod(spec["input_shape"]), spec["classes"],
                           element_bytes)
    return convnet_profile(width, depth, spec["input_shape"], spec["classes"],
                           element_bytes)


def build_builtin(name, width=0, depth=0):
    """The real Keras model `tfpar.train` builds (imports TensorFlow; for checking the
    formulas against the symbolic trace, and for calibration runs)."""
    from tfpar import models  # the model zoo: the one place the planner imports it

    spec = BUILTIN[name]
    return models.build(name, spec["input_shape"], spec["classes"], width=width,
                        depth=depth)
