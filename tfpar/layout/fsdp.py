"""ZeRO stage 3 (`--zero_stage=3`): every weight split over a DTensor mesh's `batch` axis.

FSDP-style data parallelism on the mesh (`tensor_parallel=1`, `batch` = all devices):
`tfpar.layout.run.build` creates each weight inside `variables.weights_over_batch`, so it
is split over `batch` on its first dimension that divides by the replicas
(`variables.over_batch`; a weight with no such dimension, e.g. a bias of 18 over 4, stays
whole), and the optimizer's slots, created with their weight's layout, are split the same
way. Between steps each device holds 1/N of the parameters and of the optimizer state.

In the step, `gathered` relayouts each split weight to its layout without `batch` where the
forward pass reads it (an all-gather), so every op sees the whole weight as on one device.
Its gradient runs the relayout backwards: the batch-summed gradient arrives split like
the weight, and the element-wise update runs on each device's piece. DTensor does not
gather a split weight by itself for every op (measured on TF 2.21: a `Gather` of an
embedding split on its rows fails in SPMD expansion, "input and output layout do not agree
on non-axis dim 1"), hence the explicit relayout.

The gathers are ops of the compiled step, scheduled by TensorFlow when their inputs are
ready (all at the start of the step), not one layer at a time: the whole weights exist
transiently during the step; the saving is at rest (parameters, gradients' update,
optimizer state), not in the step's peak.
"""

from tensorflow.experimental import dtensor

from tfpar.layout.mesh import BATCH


def whole_over_batch(layout):
    """`layout` (a DTensor `Layout`) with its `batch` axis replaced by unsharded."""
    specs = [dtensor.UNSHARDED if s == BATCH else s for s in layout.sharding_specs]
    return dtensor.Layout(specs, layout.mesh)


def gathered(mapping):
    """`(variable, value)` pairs with each value split over `batch` relayouted whole over
    it (its other axes kept); values of other variables unchanged."""
    out = []
    for variable, value in mapping:
        inner = getattr(variable, "value", variable)
        layout = getattr(inner, "layout", None)
        if layout is not None and BATCH in layout.sharding_specs:
            value = dtensor.relayout(value, whole_over_batch(layout))
        out.append((variable, value))
    return out
