"""Layouts of activations on a mesh: a layer's inputs or output relaid out as a rule says.

Keras names a layer's output in a `LayoutMap` by the layer's path plus `/output`
(`Layer.__call__` looks that key up and hands the output to `distribute_tensor`, which
Keras's TensorFlow backend does not have; `tfpar.layout.enable` gives it one that calls
`relayout_value`). tfpar's own entry points honour such rules from outside the model,
and rules for a layer's tensor inputs (`path + "/input"`) as well: `apply` replaces, on
the instance, the `call` of every layer a rule matches, so that inside the mesh step its
inputs and its output are `dtensor.relayout` to the rules' layouts. DTensor
inserts the collectives each change needs (an all-gather where a split dimension becomes
whole, a reduce-scatter where a sum over the `model` axis lands on a split dimension)
and nothing else changes: the same ops run on the same values, so a run with activation
layouts equals one without.

Input rules are not decoration. Measured on TF 2.21: with the attention's input split on
the sequence and its query/key/value outputs split on heads, DTensor's expansion of the
`EinsumDense` projections returned wrong values (logits 5.3 away from one device's, no
error), and without the head layouts it tried to all-to-all the boolean causal mask and
failed; gathering the sequence explicitly at the attention's input (`…/attn/input`)
is exact.

In the per-replica step of a compressed batch-axis reduction (`tfpar.layout.reduction`:
`tf.vectorized_map` over the batch reshaped `[data_parallel, m, ...]`) the relayouts are
traced under `per_replica`: each is vectorized into one relayout of the stacked value, the
replicas' dimension split on `batch` and the rule's `batch` entry whole (the examples of
one replica stay on its device). TF 2.21 has no vectorized relayout: `vectorized_map`
falls back to a `while_loop`, which crashes DTensor when the step runs (a segmentation
fault; `tfpar.patches` entry `vectorized_relayout`).

Activation axes name every dimension, the batch included: `("batch", "model", None)` is
a `[batch, sequence, width]` activation split on the sequence over the `model` axis (see
`tfpar.layout.presets.sequence_parallel`).
"""

import functools
import re

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import patches
from tfpar.errors import ConfigError
from tfpar.layout.mesh import batch_axis

OUTPUT, INPUT = "/output", "/input"


def is_activation_rule(rule):
    """True for a `(regex, axes)` rule about a layer's output or inputs."""
    return rule[0].endswith((OUTPUT, INPUT))


def weight_rules(rules):
    """The rules about weights (all but the `…/output` and `…/input` rules)."""
    return [rule for rule in rules if not is_activation_rule(rule)]


def apply(model, mesh, rules):
    """Lays out `model`'s layer inputs and outputs as the activation rules of `rules` say.

    Args:
        model: a built Keras model (its layers, nested ones included, have paths).
        mesh: the `keras.distribution.DeviceMesh` the model's variables live on.
        rules: `(regex, axes)` rules; those whose regex ends in `/output` lay out the
            output of the layers whose path the rest fully matches, those ending in
            `/input` every tensor input of the layer's call with as many dimensions as
            `axes`; the first rule of each kind matching a layer wins.

    Returns:
        `{layer path: {"input": axes, "output": axes}}` of the layers laid out.

    Raises:
        ConfigError: an activation rule matches no layer, or names an axis the mesh
            lacks. At the first trace: an output whose rank does not fit, or a dimension
            that does not split over its axis.
    """
    kinds = {OUTPUT: "output", INPUT: "input"}
    active = [(regex[:-len(suffix)], kinds[suffix], tuple(axes)) for regex, axes in rules
              for suffix in kinds if regex.endswith(suffix)]
    names = mesh.backend_mesh.dim_names
    for regex, kind, axes in active:
        if any(axis is not None and axis not in names for axis in axes):
            raise ConfigError("layout rule", f"{regex}/{kind}: {axes}",
                              f"axes must be None or one of the mesh's {tuple(names)}")
    used, laid_out = set(), {}
    for layer in patches.sublayers(model):
        path = layer_path(layer)
        chosen = {}
        for index, (regex, kind, axes) in enumerate(active):
            if kind not in chosen and re.fullmatch(regex, path):
                chosen[kind] = axes
                used.add(index)
        if chosen:
            _relayout(layer, path, chosen, mesh)
            laid_out[path] = chosen
    for index, (regex, kind, _) in enumerate(active):
        if index not in used:
            paths = [layer_path(layer) for layer in
                     patches.sublayers(model)]
            raise ConfigError("layout rule", f"{regex}/{kind}",
                              "matches no layer of the model (full match of the layer's "
                              f"path, e.g. {', '.join(paths[:4])})")
    return laid_out


def per_replica():
    """A context in which relayouts traced inside `tf.vectorized_map` over the
    data-parallel replicas (split on the mesh's batch axis) are vectorized (see the module
    docstring)."""
    return patches.relayouts_vectorized(stacked_over_replicas)


def stacked_over_replicas(layout):
    """`layout` of one replica's value, of the values of all replicas stacked in front:
    that dimension split on the batch axis, the batch axis taken out of the others."""
    batch = batch_axis(layout.mesh)
    specs = [dtensor.UNSHARDED if spec == batch else spec for spec in layout.sharding_specs]
    return dtensor.Layout([batch] + specs, layout.mesh)


def laid_out(model):
    """`{layer path: {"input"/"output": axes}}` of the layers `apply` laid out."""
    return {layer_path(layer): layer._tfpar_activation_axes
            for layer in patches.sublayers(model)
            if getattr(layer, "_tfpar_activation_axes", None)}


def layer_path(layer):
    """The path `LayoutMap` keys name a layer by (its name if it has none)."""
    return getattr(layer, "path", None) or layer.name


def _relayout(layer, path, chosen, mesh):
    """Replaces `layer.call` on the instance by one that relays out its tensor inputs
    (`chosen["input"]`) and its output (`chosen["output"]`)."""
    layouts = {kind: dtensor.Layout([dtensor.UNSHARDED if a is None else a for a in axes],
                                    mesh.backend_mesh)
               for kind, axes in chosen.items()}
    call = layer.call

    def fit(value, kind):
        axes = chosen[kind]
        for size, axis in zip(value.shape, axes):
            parts = 1 if axis is None else mesh.backend_mesh.dim_size(axis)
            if size is not None and size % parts:
                raise ConfigError("layout rule", f"{path}/{kind}: {axes}",
                                  f"the shape {tuple(value.shape)} does not split {parts} "
                                  f"ways along the {axis!r} axis; use a size divisible "
                                  f"by {parts}")
        return relayout_value(value, layouts[kind])

    @functools.wraps(call)
    def relaid_call(*args, **kwargs):
        if "input" in chosen:
            rank = len(chosen["input"])
            args = [fit(a, "input") if tf.is_tensor(a) and a.shape.rank == rank else a
                    for a in args]
        output = call(*args, **kwargs)
        if "output" not in chosen:
            return output
        if not tf.is_tensor(output) or output.shape.rank != len(chosen["output"]):
            raise ConfigError("layout rule", f"{path}/output: {chosen['output']}",
                              f"the layer's output is {_describe(output)}; give one axis "
                              "per dimension")
        return fit(output, "output")

    object.__setattr__(layer, "call", relaid_call)
    object.__setattr__(layer, "_tfpar_activation_axes", dict(chosen))


def relayout_value(value, layout):
    """`value` relaid out to `layout` through the layout with every `model` split removed.

    Measured on TF 2.21: one `dtensor.relayout` straight from a sum over `model` not yet
    reduced (a row-parallel output) to a sequence split is exact forward but its gradient
    is not (embeddings 0.08 off after one SGD step), and from a sequence split to a
    gathered input DTensor's gradient failed ("EmitAllScatter … not more sharded");
    through the whole layout first both are exact (the reduce, then a local slice).
    """
    batch = batch_axis(layout.mesh)
    whole = dtensor.Layout([s if s == batch else dtensor.UNSHARDED
                            for s in layout.sharding_specs], layout.mesh)
    return dtensor.relayout(dtensor.relayout(value, whole), layout)


def _describe(output):
    if tf.is_tensor(output):
        return f"of shape {tuple(output.shape)}"
    return f"a {type(output).__name__}"
