"""A GPT-style decoder: token + position embedding, pre-norm blocks, a language-model head.

Layer names are stable so that tensor-parallel presets and stage splits can match them:
`embed/token`, `embed/position`, `block_{i}/attn/{query,key,value,attention_output}`,
`block_{i}/mlp_fc`, `block_{i}/mlp_proj`, `block_{i}/ln_{1,2}`, `ln_f`, `lm_head`.
"""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfpar")
class Embedding(keras.layers.Layer):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab_size, seq_len, width, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.seq_len, self.width = vocab_size, seq_len, width
        self.token = keras.layers.Embedding(vocab_size, width, name="token")
        self.position = keras.layers.Embedding(seq_len, width, name="position")

    def call(self, tokens):
        positions = ops.arange(ops.shape(tokens)[-1])
        return self.token(tokens) + self.position(positions)[None]

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "seq_len": self.seq_len, "width": self.width}


@keras.saving.register_keras_serializable(package="tfpar")
class Block(keras.layers.Layer):
    """Pre-norm decoder block: causal self-attention and a 4× GELU MLP, both residual."""

    def __init__(self, width, heads, **kwargs):
        super().__init__(**kwargs)
        self.width, self.heads = width, heads
        self.ln_1 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_1")
        self.attn = keras.layers.MultiHeadAttention(heads, width // heads, name="attn")
        self.ln_2 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_2")
        self.mlp_fc = keras.layers.Dense(4 * width, activation="gelu", name="mlp_fc")
        self.mlp_proj = keras.layers.Dense(width, name="mlp_proj")

    def build(self, input_shape):
        self.ln_1.build(input_shape)
        self.attn.build(input_shape, input_shape)
        self.ln_2.build(input_shape)
        self.mlp_fc.build(input_shape)
        self.mlp_proj.build(tuple(input_shape[:-1]) + (4 * self.width,))

    def call(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, use_causal_mask=True)
        return x + self.mlp_proj(self.mlp_fc(self.ln_2(x)))

    def get_config(self):
        return {**super().get_config(), "width": self.width, "heads": self.heads}


def transformer(input_shape=(16,), num_classes=18, width=64, depth=2, heads=4):
    """A GPT-style decoder over token sequences of length `input_shape[0]` with a vocabulary
    of `num_classes`; outputs next-token logits at every position.

    >>> model = transformer(input_shape=(16,), num_classes=18)
    >>> model.output_shape
    (None, 16, 18)
    """
    seq_len = input_shape[0]
    tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
    x = Embedding(num_classes, seq_len, width, name="embed")(tokens)
    for i in range(depth):
        x = Block(width, heads, name=f"block_{i}")(x)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")(x)
    logits = keras.layers.Dense(num_classes, name="lm_head")(x)
    return keras.Model(tokens, logits, name="transformer")
