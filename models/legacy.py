"""The mlp and convnet of `tfpar.models` built with legacy Keras (`tf_keras`, Keras 2).

tensorflow-model-optimization (pruning, quantization-aware training) accepts only
`tf_keras` models. Layer names and sizes match the Keras 3 builders; initialisers are
seeded explicitly, so a model is the same whatever strategy scope it is built under.
(The transformer has no `tf_keras` twin: its custom layers are Keras 3 only.)

>>> model = build("mlp", (32,), 10)
>>> model.output_shape
(None, 10)
"""

import tf_keras


def _init(seed, i):
    return tf_keras.initializers.GlorotUniform(seed=seed * 1000 + i)


def mlp(input_shape=(32,), num_classes=10, width=256, depth=2, seed=0):
    """`depth` ReLU layers of `width` units, then logits (`dense_0 … dense_{depth-1}`,
    `logits`), as `tfpar.models.mlp.mlp`."""
    inputs = tf_keras.Input(shape=input_shape, name="features")
    x = inputs
    for i in range(depth):
        x = tf_keras.layers.Dense(width, activation="relu", kernel_initializer=_init(seed, i),
                                  name=f"dense_{i}")(x)
    outputs = tf_keras.layers.Dense(num_classes, kernel_initializer=_init(seed, depth),
                                    name="logits")(x)
    return tf_keras.Model(inputs, outputs, name="mlp")


def convnet(input_shape=(16, 16, 3), num_classes=10, width=32, depth=2, seed=0):
    """A conv stem, `depth` residual blocks of `width` channels with GroupNormalization,
    pooling, logits, as `tfpar.models.convnet.convnet`."""
    layers = tf_keras.layers
    count = iter(range(1000))

    def conv(name):
        return layers.Conv2D(width, 3, padding="same", kernel_initializer=_init(seed, next(count)),
                             name=name)

    inputs = tf_keras.Input(shape=input_shape, name="images")
    x = layers.GroupNormalization(groups=8, name="stem_norm")(conv("stem_conv")(inputs))
    x = layers.Activation("relu")(x)
    for i in range(depth):
        y = layers.GroupNormalization(groups=8, name=f"block_{i}_norm1")(
            conv(f"block_{i}_conv1")(x))
        y = layers.Activation("relu")(y)
        y = layers.GroupNormalization(groups=8, name=f"block_{i}_norm2")(
            conv(f"block_{i}_conv2")(y))
        x = layers.Activation("relu")(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes, kernel_initializer=_init(seed, next(count)),
                           name="logits")(x)
    return tf_keras.Model(inputs, outputs, name="convnet")


BUILDERS = {"mlp": mlp, "convnet": convnet}


def build(name, input_shape, num_classes, width=0, depth=0, seed=0):
    """Builds `tf_keras` model `name` ("mlp" or "convnet"); `width`/`depth` of 0 keep the
    default size.

    Raises:
        ValueError: `name` has no `tf_keras` builder.
    """
    if name not in BUILDERS:
        raise ValueError(f"model={name!r} has no tf_keras builder: choose one of "
                         f"{', '.join(BUILDERS)}")
    kwargs = {"seed": seed}
    if width:
        kwargs["width"] = width
    if depth:
        kwargs["depth"] = depth
    return BUILDERS[name](input_shape=input_shape, num_classes=num_classes, **kwargs)
