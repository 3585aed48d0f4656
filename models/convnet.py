import keras


def convnet(input_shape=(16, 16, 3), num_classes=10, width=32, depth=2):
    """A small ResNet: a conv stem, `depth` residual blocks of `width` channels, pooling,
    logits.

    Normalisation is GroupNormalization rather than BatchNormalization: its statistics are
    per example, so a data-parallel step computes exactly what one device computes on the
    whole batch (BatchNormalization would use each replica's own batch statistics).

    >>> model = convnet(input_shape=(16, 16, 3), num_classes=10)
    >>> model.output_shape
    (None, 10)
    """
    inputs = keras.Input(shape=input_shape, name="images")
    x = keras.layers.Conv2D(width, 3, padding="same", name="stem_conv")(inputs)
    x = keras.layers.GroupNormalization(groups=8, name="stem_norm")(x)
    x = keras.layers.Activation("relu")(x)
    for i in range(depth):
        y = keras.layers.Conv2D(width, 3, padding="same", name=f"block_{i}_conv1")(x)
        y = keras.layers.GroupNormalization(groups=8, name=f"block_{i}_norm1")(y)
        y = keras.layers.Activation("relu")(y)
        y = keras.layers.Conv2D(width, 3, padding="same", name=f"block_{i}_conv2")(y)
        y = keras.layers.GroupNormalization(groups=8, name=f"block_{i}_norm2")(y)
        x = keras.layers.Activation("relu")(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="convnet")
