"""Work-around: DTensor splits a `tf.concat` along its own axis when that axis is negative.

Measured on TF 2.21: DTensor's layout check for `ConcatV2` compares the concat axis with
each dimension's index without first turning a negative axis into a positive one, so
`tf.concat([a, b], axis=-1)` whose output a consumer wants split on that axis (a `Dense`
after `keras.layers.Concatenate` whose kernel is split on its rows, `("model", None)`)
is computed shard by shard: each device concatenates its own halves of `a` and `b`, the
columns come out interleaved, and nothing fails (a forward 2.4 off, weights 8e-2 off after
4 steps). With a positive axis DTensor refuses the same layout instead ("Concat op SPMD
with concat dimension in sharded dimension is not supported").

While a mesh step is traced, `concat_axis_whole` relays out every new `ConcatV2`'s
output to a layout whose concat axis is whole, whose first other dimension (the batch,
in an activation) keeps the layout DTensor gives it (`dtensor.MATCH`; DTensor takes one
per layout) and whose other dimensions are whole: the concat then runs on whole rows, and
where a consumer wants a dimension split DTensor slices it after. Values are unchanged, so a step
with it equals one device (registry entry `op_callbacks` of `tfpar.patches`).
"""

import contextlib
import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import patches

_CONCAT = "ConcatV2"


def _callback(mesh, op_type, inputs, attrs, outputs, op_name=None, graph=None):
    """The op callback: a `ConcatV2` built in a graph gets its output relaid out with the
    concat axis whole (shape arithmetic, rank-1 integers, is left as it is)."""
    del attrs, op_name
    if op_type != _CONCAT or graph is None:
        return None
    out = outputs[0]
    rank = out.shape.rank
    if not rank or (out.dtype.is_integer and rank == 1):
        return None
    axis = tf.get_static_value(inputs[-1])
    if axis is None:  # an axis known only when run: every dimension whole
        specs = [dtensor.UNSHARDED] * rank
    else:  # DTensor takes one MATCH per layout: the first other dimension (the batch's)
        axis = int(axis) % rank
        specs = [dtensor.UNSHARDED] * rank
        if rank > 1:
            specs[1 if axis == 0 else 0] = dtensor.MATCH
    return [dtensor.relayout(out, dtensor.Layout(specs, mesh))]


@contextlib.contextmanager
def concat_axis_whole(mesh):
    """Within (on this thread, while a graph is built), every `tf.concat` is laid out with
    its concat axis whole on `mesh` (a `dtensor.Mesh`)."""
    with patches.op_callback_added(functools.partial(_callback, mesh)):
        yield


def traced_with_concat_axis_whole(fn, mesh):
    """`fn` wrapped so that, while it runs (is traced), `concat_axis_whole(mesh)` is on."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with concat_axis_whole(mesh):
            return fn(*args, **kwargs)
    return wrapped
