"""Profiles of a user's own Keras model by a symbolic trace: no weight is ever created.

`--model=module:function` names a function with no required arguments that returns
either a Keras model whose inputs are known (functional, or `Sequential` started with
`keras.Input`), or `(model, inputs)` where `inputs` describes one example batch for a model
that has none: a `keras.KerasTensor`, a `tf.TensorSpec`, a shape tuple (float32), or a
list/dict of them. The batch dimension may be `None`. Build the model inside the function
(not at import time) so its weights can be deferred:

    def my_gpt():
        tokens = keras.Input((2048,), dtype="int32")
        ...
        return keras.Model(tokens, logits)

    python -m tfpar.plan --model=my_models:my_gpt --devices=64 --memory_gb=80

The function runs inside a `keras.StatelessScope`, where Keras defers every variable it
creates (shape and initializer only). The model is then called once, on a one-example
placeholder, inside a `tf.Graph` that is never run, and the profile is read off that graph:

- parameters: the deferred variables' shapes;
- forward FLOPs: 2 × multiply-adds of every matmul, einsum and convolution whose inputs
  depend on the model's input (initializers are not counted);
- activation bytes: the distinct tensors that the gradient of each such op (and of
  element-wise products, divisions and nonlinear functions) reads: inputs of products,
  outputs of ReLU/softmax/exp-like functions;
- pipeline cuts and the tensor crossing each (`tfpar.pipeline.partition`'s rule: one
  tensor crosses), and the tensor-parallel degrees `tfpar.layout.presets` can split it by.
"""

import contextlib
import importlib
import math
import re

from tfpar.errors import ConfigError
from tfpar.plan.cost import Profile

_PRODUCTS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
             "Conv2D", "Conv3D", "DepthwiseConv2dNative"}
_READS_INPUTS = _PRODUCTS | {"Mul", "RealDiv", "Div", "DivNoNan", "Square", "Pow", "Erf",
                             "Log", "Log1p", "Softplus", "Sin", "Cos", "SquaredDifference",
                             "Maximum", "Minimum", "MaxPool", "LeakyRelu"}
_READS_OUTPUTS = {"Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Softmax", "LogSoftmax",
                  "Exp", "Rsqrt", "Sqrt", "Reciprocal"}


def load(spec):
    """The function `module:function` names.

    Raises:
        ConfigError: not `module:function`, or it cannot be imported.
    """
    if not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", spec):
        raise ConfigError("model", spec, "use mlp, convnet, transformer or "
                          "'package.module:function' returning a Keras model")
    module_name, fn_name = spec.split(":")
    try:
        return getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise ConfigError("model", spec, f"could not load it ({err}); give "
                          "'module:function' importable from the working directory") from None


def trace_profile(spec, element_bytes=4):
    """The `Profile` of the model `module:function` returns, traced symbolically.

    Raises:
        ConfigError: the function cannot be loaded, or returns something else than a
            model with known inputs or `(model, inputs)`.
    """
    fn = load(spec)
    import keras

    with deferred_weights():
        made = fn()
    model, inputs = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, keras.Model):
        raise ConfigError("model", spec, f"returned {type(made).__name__}; return a "
                          "keras.Model, or (model, input spec) for a model without inputs")
    if inputs is None:
        inputs = getattr(model, "inputs", None)
        if not inputs:
            raise ConfigError("model", spec, "returned a model without inputs; return "
                              "(model, keras.KerasTensor((None, ...))) or start it with "
                              "keras.Input")
    return profile_traced(model, inputs, spec, element_bytes)


@contextlib.contextmanager
def deferred_weights():
    """A `keras.StatelessScope` in which Keras creates variables as shape + initializer
    only and never initializes them: not when the scope ends (`initialize_variables=False`)
    and not when a later scope ends (they are taken off Keras's list of variables waiting
    to be initialized, restoring the list as it was)."""
    import keras
    from tfpar import patches

    with patches.uninitialized_variables_kept():
        with keras.StatelessScope(initialize_variables=False):
            yield


def _placeholders(tf, inputs):
    """One-example placeholders for an input description (nested like it)."""
    import keras

    if isinstance(inputs, dict):
        return {k: _placeholders(tf, v) for k, v in inputs.items()}
    if isinstance(inputs, list):
        return [_placeholders(tf, v) for v in inputs]
    if isinstance(inputs, tuple) and all(isinstance(d, int) or d is None for d in inputs):
        shape, dtype = (1,) + tuple(inputs), "float32"  # a shape without batch
    elif isinstance(inputs, (keras.KerasTensor, tf.TensorSpec)):
        shape, dtype = (1,) + tuple(inputs.shape[1:]), inputs.dtype
    else:
        raise ConfigError("model", repr(inputs), "describe inputs as a keras.KerasTensor, "
                          "tf.TensorSpec or shape tuple (or a list/dict of them)")
    if any(d is None for d in shape):
        raise ConfigError("model", repr(inputs), "give every dimension but the batch")
    return tf.compat.v1.placeholder(tf.as_dtype(str(dtype).replace("tf.", "")), shape)


def profile_traced(model, inputs, name, element_bytes=4):
    """A `Profile` of `model` (weights deferred or real; none is read) on one example of
    `inputs`, from a graph that is built and never run."""
    import tensorflow as tf

    graph = tf.Graph()
    with deferred_weights(), graph.as_default():
        x = _placeholders(tf, inputs)
        if isinstance(x, list) and len(x) == 1:
            x = x[0]
        model(x, training=True)
    flops, kept = graph_costs(graph)
    weights = [w for w in model.trainable_weights]
    params = int(sum(math.prod(w.shape) for w in weights))
    blocks, boundary = _cuts(model, element_bytes)
    tensor, syncs = _tensor_parallel(weights)
    from tfpar.compression import powersgd

    return Profile(
        name=name, params=params, flops_per_example=flops,
        activation_bytes_per_example=kept * element_bytes / 4,
        boundary_bytes_per_example=boundary, blocks=blocks,
        tp_syncs_per_block=syncs / blocks, max_tensor_parallel=tensor,
        matrix_shapes=tuple(powersgd.matrix_shape(w.shape) for w in weights
                            if len(w.shape) >= 2))


def graph_costs(graph):
    """`(forward FLOPs, bytes the backward reads)` of the ops of `graph` that depend on
    its placeholders (one example)."""
    reached = set()
    flops, kept = 0.0, {}
    for op in graph.get_operations():  # in creation order: inputs come first
        if op.type == "Placeholder" or any(t.op.name in reached for t in op.inputs):
            reached.add(op.name)
        else:
            continue
        if op.type in _PRODUCTS:
            flops += _product_flops(op)
        tensors = op.inputs if op.type in _READS_INPUTS else (
            op.outputs if op.type in _READS_OUTPUTS else ())
        for t in tensors:
            if t.op.name in reached and t.dtype.is_floating and t.shape.is_fully_defined():
                kept[t.name] = t.shape.num_elements() * t.dtype.size
    return flops, float(sum(kept.values()))


def _product_flops(op):
    out = op.outputs[0].shape
    if not out.is_fully_defined():
        return 0.0
    if op.type == "MatMul":
        a = op.inputs[0].shape
        inner = a[0] if op.get_attr("transpose_a") else a[1]
        return 2.0 * out.num_elements() * inner
    if op.type.startswith("BatchMatMul"):
        a = op.inputs[0].shape
        adj = op.get_attr("adj_x")
        return 2.0 * out.num_elements() * (a[-2] if adj else a[-1])
    if op.type == "Einsum":
        lhs, _ = op.get_attr("equation").decode().replace(" ", "").split("->")
        sizes = {}
        for term, t in zip(lhs.split(","), op.inputs):
            if "." in term:
                return 2.0 * out.num_elements()  # ellipsis: not worth parsing
            for letter, dim in zip(term, t.shape):
                sizes[letter] = dim
        return 2.0 * math.prod(sizes.values())
    # Convolutions: each output element takes kernel-window x input-channel products.
    kernel = op.inputs[1].shape
    if op.type == "DepthwiseConv2dNative":
        return 2.0 * out.num_elements() * kernel[0] * kernel[1]
    return 2.0 * out.num_elements() * math.prod(kernel[:-1])


def _cuts(model, element_bytes):
    """`(blocks, boundary bytes)`: pipeline cuts `tfpar.pipeline.partition` allows + 1,
    and the largest tensor crossing one (per example)."""
    from tfpar.pipeline import partition

    try:
        functional, nodes = partition._graph(model)
        cuts, _ = partition._valid_cuts(functional, nodes)
    except Exception:  # noqa: BLE001 - any model the partitioner cannot read: no cuts
        cuts = {}
    sizes = [math.prod(t.shape[1:]) * element_bytes for t in cuts.values()
             if all(d is not None for d in t.shape[1:])]
    out = model.outputs[0].shape if getattr(model, "outputs", None) else None
    fallback = math.prod(out[1:]) * element_bytes if out is not None else 0
    return len(sizes) + 1, float(max(sizes, default=fallback))


def _tensor_parallel(weights):
    """`(degree the presets' split dimensions all divide, row-parallel splits)`: what
    `tfpar.layout.presets` rules would shard in these weights. Each row-parallel split
    (a Megatron pair's second kernel, attention's output) is one all-reduce forward."""
    from tfpar.layout import presets

    split, row = 0, 0
    # The vocabulary split is left out: like the formulas, only heads and widths limit it.
    for rule, axes in presets.preset_rules(["megatron_mlp", "attention_heads"]):
        for w in weights:
            if len(w.shape) != len(axes) or not re.fullmatch(rule, w.path):
                continue
            for dim, axis in zip(w.shape, axes):
                if axis is not None:
                    split = math.gcd(split, dim)
            row += axes[0] is not None and len(axes) >= 2 and w.path.endswith("kernel")
    return max(1, split), row
