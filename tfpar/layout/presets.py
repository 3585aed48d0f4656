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

Models in `tfpar.models` know nothing of this; the regexes match their layer names.
"""

import keras

from tfpar.errors import ConfigError
from tfpar.layout.mesh import MODEL

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


PRESETS = {"megatron_mlp": megatron_mlp, "attention_heads": attention_heads,
           "vocab_parallel": vocab_parallel}
MODEL_PRESETS = {"mlp": ("megatron_mlp",),
                 "transformer": ("megatron_mlp", "attention_heads", "vocab_parallel")}


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


def model_presets(model_name):
    """The preset names that fit `models.build(model_name, …)`.

    Raises:
        ConfigError: the model has no tensor-parallel preset.
    """
    if model_name not in MODEL_PRESETS:
        raise ConfigError("model", model_name,
                          f"tensor parallelism has presets for {', '.join(MODEL_PRESETS)}; "
                          "use --tensor_parallel=1 or give your own layout rules")
    return MODEL_PRESETS[model_name]


def layout_map(mesh, rules):
    """A `keras.distribution.LayoutMap` on `mesh` holding `rules`.

    Args:
        mesh: a `keras.distribution.DeviceMesh` (see `make_mesh`).
        rules: `(regex, axes)` pairs, e.g. from `preset_rules`.

    Example:
    >>> lm = layout_map(mesh, preset_rules(["megatron_mlp"]))
    >>> lm["dense_0/kernel"].axes
    (None, 'model')
    """
    result = keras.distribution.LayoutMap(mesh)
    for regex, axes in rules:
        result[regex] = tuple(axes)
    return result
