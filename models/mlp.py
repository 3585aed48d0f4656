import keras


def mlp(input_shape=(32,), num_classes=10, width=256, depth=2):
    """A multi-layer perceptron: `depth` ReLU layers of `width` units, then logits.

    Layers are named `dense_0 … dense_{depth-1}` and `logits`, so layout presets and
    stage splits can find them.

    >>> model = mlp(input_shape=(32,), num_classes=10)
    >>> model.output_shape
    (None, 10)
    """
    inputs = keras.Input(shape=input_shape, name="features")
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="mlp")
