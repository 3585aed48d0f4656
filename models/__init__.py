"""Plain Keras 3 models. No parallelism inside: tfpar applies it from outside."""

from tfpar.models.convnet import convnet
from tfpar.models.mlp import mlp
from tfpar.models.transformer import transformer

BUILDERS = {"mlp": mlp, "convnet": convnet, "transformer": transformer}


def build(name, input_shape, num_classes, width=0, depth=0):
    """Builds model `name` for inputs of `input_shape` and `num_classes` outputs.

    `width`/`depth` of 0 keep the model's default size.
    """
    kwargs = {}
    if width:
        kwargs["width"] = width
    if depth:
        kwargs["depth"] = depth
    return BUILDERS[name](input_shape=input_shape, num_classes=num_classes, **kwargs)
