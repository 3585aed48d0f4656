"""Layout presets: rules from weight-path regexes to shardings, as plain data.

A rule is `(regex, axes)`: a variable whose path fully matches `regex` gets the layout
`axes`, one entry per dimension, `"model"` where the dimension is split over the `model`
mesh axis and `None` where it is whole. Variables no rule matches are replicated. Rules
go into a Keras `LayoutMap`, the vocabulary `keras.distribution.ModelParallel` reads.

Presets (Megatron-LM, Shoeybi et al. 2019):
- `megatron_mlp`: the first Dense of a pair split on its output axis (column parallel,
  bias split too), the second on its input axis (row parallel, bias whole), so the
  activation between them stays split and one all-reduce follows the pair.
- `attention_heads`: query/key/value kernels `(d, heads, head_dim)` split on heads
  (column), the output kernel `(heads, head_dim, d)` split on heads (row).
- `vocab_parallel`: the token embedding `(vocab, d)` split on vocab, the language-model
  head `(d, vocab)` split on vocab (column).
- `sequence_parallel` (Korthikanti et al. 2022, Megatron-LM's `--sequence-parallel`): rules
  for activations, not weights. Outside the attention and MLP blocks (layer norms,
  residual adds, dropout) the `[batch, sequence, width]` activations are split along the
  sequence over the `model` axis, where plain tensor parallelism keeps them whole on every
  device. Before a column-parallel layer the sequence is all-gathered, after a
  row-parallel one the sum over `model` is reduce-scattered onto the sequence split
  (Megatron's g and g-bar): the same bytes as the all-reduce it replaces, and the norms'
  work and activations cut by `tensor_parallel`. Used on top of the three above.

A rule whose regex ends in `/output` (Keras's `LayoutMap` key for a layer's output) or
`/input` lays out that layer's output or inputs; `tfpar.layout.activations` applies those,
`layout_map` takes the others.

Models in `tfpar.models` know nothing of this; the regexes match their layer names.
"""

import keras

from tfpar import compat
from tfpar.errors import ConfigError
from tfpar.layout.activations import INPUT, OUTPUT, weight_rules
from tfpar.layout.mesh import BATCH, MODEL

_ANY = r"(?:.*/)?"  # any enclosing layers


def megatron_mlp(first=_ANY + r"(?:dense_\d*[02468]|mlp_fc)",
                 second=_ANY + r"(?:dense_\d*[13579]|mlp_proj)"):
    """Column-then-row split of Dense pairs.

    Args:
        first: regex of the first Dense layers' paths (default: `dense_0`, `dense_2`, …
            of `models.mlp` and `block_i/mlp_fc` of `models.transformer`).
        second: regex of the second Dense layers' paths (`dense_1`, `dense_3`, …,
            `block_i/mlp_proj`).

    Returns:
        A list of `(regex, axes)` rules.
    """
    return [(first + "/kernel", (None, MODEL)), (first + "/bias", (MODEL,)),
            (second + "/kernel", (MODEL, None))]


def attention_heads(attention=_ANY + r"attn"):
    """Split of `keras.layers.MultiHeadAttention` by heads.

    Args:
        attention: regex of the attention layers' paths (default `…/attn`).

    Returns:
        A list of `(regex, axes)` rules.
    """
    qkv = attention + r"/(?:query|key|value)"
    return [(qkv + "/kernel", (None, MODEL, None)), (qkv + "/bias", (MODEL, None)),
            (attention + "/attention_output/kernel", (MODEL, None, None))]


def vocab_parallel(embedding=_ANY + r"embed/token", head=_ANY + r"lm_head"):
    """Split of the token embedding and the language-model head over the vocabulary.

    Args:
        embedding: regex of the `keras.layers.Embedding` path (default `…embed/token`).
        head: regex of the output Dense layer's path (default `…lm_head`).

    Returns:
        A list of `(regex, axes)` rules.
    """
    return [(embedding + "/embeddings", (MODEL, None)),
            (head + "/kernel", (None, MODEL)), (head + "/bias", (MODEL,))]


def sequence_parallel(blocks=_ANY + r"block_\d+", embedding=_ANY + "embed",
                      final_norm=_ANY + "ln_f", head=_ANY + "lm_head"):
    """Megatron's sequence parallelism for pre-norm transformer blocks, as output layouts.

    The residual stream (embedding, block and final-norm outputs) and the norms' outputs
    are split on the sequence; the inputs of the column-parallel layers (the attention,
    the MLP's first Dense, the head) are gathered whole, their outputs split on heads or
    units; the row-parallel outputs (attention's, the MLP's second Dense) are split on
    the sequence again.

    Args:
        blocks: regex of the blocks' paths, each holding `ln_1`, `attn`, `ln_2`,
            `mlp_fc`, `mlp_proj` (default `block_i` of `models.transformer`).
        embedding, final_norm, head: regexes of the embedding, the final norm and the
            language-model head.

    Returns:
        A list of `(regex + "/output" or "/input", axes)` rules, axes over
        `[batch, sequence, …]` (`tfpar.layout.activations`).
    """
    split = (BATCH, MODEL, None)    # [batch, sequence, width], the sequence split
    whole = (BATCH, None, None)     # gathered (Megatron's g) before a column-parallel layer
    units = (BATCH, None, MODEL)    # a column-parallel output: its units split
    heads = (BATCH, None, MODEL, None)  # [batch, sequence, heads, head_dim]
    return [(embedding + OUTPUT, split),
            (blocks + "/ln_1" + OUTPUT, split),
            (blocks + "/attn" + INPUT, whole),
            (blocks + r"/attn/(?:query|key|value)" + OUTPUT, heads),
            (blocks + "/attn" + OUTPUT, split),
            (blocks + "/ln_2" + OUTPUT, split),
            (blocks + "/mlp_fc" + INPUT, whole),
            (blocks + "/mlp_fc" + OUTPUT, units),
            (blocks + "/mlp_proj" + OUTPUT, split),
            (blocks + OUTPUT, split),
            (final_norm + OUTPUT, split),
            (head + INPUT, whole)]  # its output: as vocab_parallel leaves it (the
                                    # vocabulary may not split over `model`)


PRESETS = {"megatron_mlp": megatron_mlp, "attention_heads": attention_heads,
           "vocab_parallel": vocab_parallel, "sequence_parallel": sequence_parallel}
MODEL_PRESETS = {"mlp": ("megatron_mlp",),
                 "transformer": ("megatron_mlp", "attention_heads", "vocab_parallel")}
# Presets a model takes on top of its own when asked (`--sequence_parallel`).
SEQUENCE_PRESETS = {"transformer": ("sequence_parallel",)}


def preset_rules(names):
    """The rules of the named presets, concatenated.

    Raises:
        ConfigError: a name is not in `PRESETS`.
    """
    rules = []
    for name in names:
        if name not in PRESETS:
            raise ConfigError("preset", name, f"choose from {', '.join(PRESETS)}")
        rules += PRESETS[name]()
    return rules


def model_presets(model_name, sequence_parallel=False):
    """The preset names that fit `models.build(model_name, …)`, with the sequence-parallel
    ones when `sequence_parallel`.

    Raises:
        ConfigError: the model has no tensor-parallel preset, or no sequence to split.
    """
    settings = compat.view(backend="dtensor", model=model_name,
                           sequence_parallel=sequence_parallel)
    compat.enforce(compat.MESH_MODEL, settings)
    compat.enforce(compat.SEQUENCE_MODEL, settings)
    return MODEL_PRESETS[model_name] + (SEQUENCE_PRESETS[model_name] if sequence_parallel
                                        else ())


def layout_map(mesh, rules):
    """A `keras.distribution.LayoutMap` on `mesh` holding the weight rules of `rules`
    (`…/output` rules are applied by `tfpar.layout.activations.apply`).

    Args:
        mesh: a `keras.distribution.DeviceMesh` (see `make_mesh`).
        rules: `(regex, axes)` pairs, e.g. from `preset_rules`.

    Examples:
        >>> lm = layout_map(mesh, preset_rules(["megatron_mlp"]))
        >>> lm["dense_0/kernel"].axes
        (None, 'model')
    """
    result = keras.distribution.LayoutMap(mesh)
    for regex, axes in weight_rules(rules):
        result[regex] = tuple(axes)
    return result
