"""Work-around: DTensor cannot lay out `StridedSlice` with a new axis (`t[None]`).

Measured on TF 2.21: in a DTensor function, `x + v[None]` fails with a garbled
`'tf.StridedSlice' op ComputeLayoutForward error` (or a `UnicodeDecodeError` from the
message, or a segmentation fault when no default mesh is set), while
`tf.expand_dims(v, 0)` works. `tfpar/models/transformer.py` adds the position embedding with
`…[None]`. While a step is traced, `tensor[spec]` whose spec only inserts axes (`None`,
`...`, `:`) is rewritten to `tf.expand_dims`, which gives the same values; every other
indexing is TensorFlow's own. The swap of `tf.Tensor.__getitem__` is registry entry
`tensor_getitem` of `tfpar.patches`.
"""

import contextlib
import functools

import tensorflow as tf

from tfpar import patches


def _only_inserts_axes(items):
    full = [i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None))
            for i in items]
    return all(full) and any(i is None for i in items) and items.count(Ellipsis) <= 1


def _getitem(tensor, spec):
    items = spec if isinstance(spec, tuple) else (spec,)
    if not _only_inserts_axes(list(items)) or tensor.shape.rank is None:
        return patches.tensor_getitem(tensor, spec)
    real = sum(1 for i in items if i is not None and i is not Ellipsis)
    fill = (slice(None),) * (tensor.shape.rank - real)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + fill + items[at + 1:]
    else:
        items = items + fill
    out = tensor
    for axis, item in enumerate(items):
        if item is None:
            out = tf.expand_dims(out, axis)
    return out


@contextlib.contextmanager
def expand_dims_for_newaxis():
    """Within, `tensor[None]`-style indexing builds `tf.expand_dims` instead of
    `StridedSlice`. Active only while the caller runs (use it around tracing)."""
    with patches.tensor_getitem_replaced(_getitem):
        yield


def traced_with_expand_dims(fn):
    """`fn` wrapped so that, while it runs (is traced), `expand_dims_for_newaxis` is on."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with expand_dims_for_newaxis():
            return fn(*args, **kwargs)
    return wrapped
