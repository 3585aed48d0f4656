"""ZeRO stage 3 (`--zero_stage=3`): every weight split over a DTensor mesh's `batch` axis.

FSDP-style data parallelism on the mesh (`batch` = the data-parallel replicas; with
`tensor_parallel>1` a weight already split over `model` is split over `batch` on top):
`tfpar.layout.run.build` creates each weight inside `variables.weights_over_batch`, so it
is split over `batch` on its first dimension that divides by the replicas
(`variables.over_batch`; a weight with no such dimension, e.g. a bias of 18 over 4, stays
whole), and the optimizer's slots, created with their weight's layout, are split the same
way. Between steps each device holds 1/N of the parameters and of the optimizer state.

Each weight is gathered one layer at a time (`gather_per_layer`, ZeRO-3 / FSDP's
"gather before use, free after"): every top-level layer with weights gets a `call` that
takes its weights' pieces, relayouts them whole over `batch` (an all-gather) just before
the layer runs, and runs inside `tf.recompute_grad`, so neither the whole weights nor the
layer's inner activations are kept for the backward pass: the backward gathers the layer's
weights again, recomputes the layer and hands back the gradient split like the weight (the
relayout's gradient, a reduce-scatter). The gather reads a zero computed from the layer's
input (`_after`), a data dependency so that TensorFlow cannot hoist every gather to the
start of the step (all pieces are ready there): at any time about one layer's weights are
whole. Exact: the same ops on the same values (a weight plus 0.0 is the weight); the cost
is one extra forward per layer, as `--recompute=full`.

With `--zero_prefetch` (the default; FSDP's forward and backward prefetch) each gather is
issued one layer early (`_prefetched`): forward, layer i's gather reads the zero of layer
i-1's input, so TensorFlow may run it beside layer i-1, but not before layer i-2 is done;
backward, layer i's recomputation also regathers layer i-1's weights, reading the zero of
layer i's output gradient (not layer i-1's), so that gather runs beside layer i's
backward. At most two layers' weights are whole at a time (besides the layers kept whole,
`--zero_keep_last_layers` below; the allocator's peak rises by
about that plus one gather's buffer: tests/test_zero3_prefetch.py), and the results are
bit-equal to gathering at each layer. The recomputation is then tfpar's own custom
gradient (`tf.recompute_grad` adds the output gradient's zero to every input of the
layer, pieces included, which would hold each gather back to its own layer).

Without tensor parallelism the gathers are all-gathers (`collective_gathers`): DTensor
otherwise lowers a relayout that gathers an axis to a sum of a zero-padded whole tensor
over it, an all-reduce of the whole weight in place of a gather of its pieces
(docs/benchmarks/memory.md has the profile); with it they stay so (DTensor's all-gather
fails to compile on a mesh with a second sharded axis, TF 2.21).

With `--nozero_reshard_after_forward` (FSDP's `reshard_after_forward=False`) a layer is not
recomputed: it gathers once a step and keeps its whole weights and its activations for
the backward pass (the relayout's gradient, a reduce-scatter, puts the weight's gradient
on the pieces); bit-equal to the default (tests/test_zero3_prefetch.py), at the memory of
every layer's whole weights (the benchmarks page measures it).

With resharding, the last layers the forward pass runs are kept whole all the same
(`--zero_keep_last_layers`, FSDP's `reshard_after_forward=False` on them, as torchtitan
leaves its last block and output layers unresharded): the backward pass starts with them,
so regathering and recomputing them would rebuild at once what the forward just freed.
With -1 (`kept_layers`; the default, 0, keeps none: -1 measured no faster) the
last layer at least as large as the median gathering layer and every layer after it: the
zoo transformer's last block, `ln_f` and `lm_head`. Each
gathers once a step (its forward gather still prefetched), keeps its whole weights and
activations until its backward, which takes the gradient from the forward's own ops and
regathers the layer before it early; bit-equal to resharding every layer
(tests/test_zero3_prefetch.py). The peak holds the kept layers' activations and whole
weights together where the recomputation held one layer's at a time.

Each layer's weight gradient should be reduced over `batch` as the backward pass reaches
it, and freed: `tfpar.train` turns DTensor's all-reduce combining off for ZeRO-3 runs
(`mesh.no_all_reduce_combining`, before DTensor starts). With it on, DTensor may merge
the layers' reductions (independent of each other) into one at the end of the backward
pass, keeping every layer's whole gradient alive until then (the largest model that trains
under a cap grows with it off: docs/benchmarks/memory.md).

With `--zero_gather=int8` (ZeRO++'s quantized weight all-gather, qwZ) a split weight of
rank >= 2 is gathered as int8 codes with one fp32 scale per index of its split dimension
(the maximum over its other dimensions: computed on each device's own rows, no
communication), and dequantized whole (`_whole_int8`); 1-D weights (biases, norms) are
gathered fp32, a scale per entry would cost more than the value. The master weights, the
optimizer and the gradient stay fp32: the backward pass hands the gradient of the
dequantized weight straight to the fp32 piece (`relayout_like`, the relayout's own
gradient). `gather_bytes` counts what each device hands to these gathers per step.

With `--compression=fp16|bf16|int8` (`tfpar.zero.reduce_scatter`) the step forms each
replica's gradient under `per_replica_gradients`: a gather's gradient comes back whole
(the codec's reduce-scatter puts it onto the pieces), and the layers run without
`tf.recompute_grad` (the per-replica map cannot vectorize its replay: DTensor's `Relayout`
has no vectorized form, TF 2.21), so each layer gathers once a step and keeps its whole weights
for the backward pass.

Layers not wrapped (no weights split over `batch`, or non-trainable state that a
recomputation would update twice) have their split weights relayouted whole at the start
of the step (`gathered`). DTensor does not gather a split weight by itself for every op
(measured on TF 2.21: a `Gather` of an embedding split on its rows fails in SPMD
expansion, "input and output layout do not agree on non-axis dim 1"), hence the explicit
relayouts.
"""

import contextlib
import functools
import math
import os
import threading
import weakref

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import patches
from tfpar.compression import codecs
from tfpar.layout.mesh import BATCH


def collective_gathers(mesh):
    """Makes DTensor lower this process's gathers to all-gathers if `mesh` (a DTensor mesh)
    has no axis of size > 1 but `batch`, else its own lowering (`patches.
    set_collective_gathers`: an environment variable DTensor reads when it compiles; its
    all-gathers fail to compile on a tensor-parallel mesh, TF 2.21). A later mesh model
    without ZeRO-3 in the same process takes it out again (`dtensor_gathers`);
    `patches.COLLECTIVE_GATHER=0` in the environment keeps DTensor's own."""
    others = [d for d in mesh.dim_names if d != BATCH and mesh.dim_size(d) > 1]
    patches.set_collective_gathers(not others)


def dtensor_gathers():
    """A mesh model built without ZeRO-3: DTensor's own lowering of gathers again if
    `collective_gathers` set it in this process (a later tensor-parallel mesh's gathers,
    e.g. a codec's rows read at a checkpoint save, fail to compile with it). A value the
    user set is left as it is (but a 0, which means DTensor's own)."""
    patches.set_collective_gathers(False, keep_users=True)


def whole_over_batch(layout):
    """`layout` (a DTensor `Layout`) with its `batch` axis replaced by unsharded."""
    specs = [dtensor.UNSHARDED if s == BATCH else s for s in layout.sharding_specs]
    return dtensor.Layout(specs, layout.mesh)


def gathered(mapping):
    """`(variable, value)` pairs with each value split over `batch` relayouted whole over
    it (its other axes kept); values of other variables unchanged."""
    out = []
    for variable, value in mapping:
        if not getattr(variable, "_tfpar_gathered_per_layer", False):
            value = _whole(variable, value)
        out.append((variable, value))
    return out


def _split_layout(variable):
    """The DTensor layout of `variable` if it is split over `batch`, else None."""
    inner = getattr(variable, "value", variable)
    layout = getattr(inner, "layout", None)
    return layout if layout is not None and BATCH in layout.sharding_specs else None


def split_mesh(variables):
    """The DTensor mesh of the first of `variables` split over `batch`, or None."""
    for variable in variables:
        layout = _split_layout(variable)
        if layout is not None:
            return layout.mesh
    return None


def batch_parts(variables):
    """The devices on the `batch` axis of the mesh the first of `variables` split over
    `batch` lives on; 0 when none is split."""
    mesh = split_mesh(variables)
    return 0 if mesh is None else mesh.dim_size(BATCH)


def split_over_batch(variables):
    """Whether any of `variables` is split over `batch` (a ZeRO-3 model's)."""
    return any(_split_layout(v) is not None for v in variables)


def _whole(variable, value, layout=None):
    """`value` of `variable` relayouted whole over `batch` (`layout`: the variable's, read
    beforehand; under a StatelessScope `variable.value` is a tensor without one)."""
    layout = layout or _split_layout(variable)
    if layout is None:
        return value
    if not _PER_REPLICA:
        return dtensor.relayout(value, whole_over_batch(layout))

    @tf.custom_gradient
    def gather(piece):  # the gradient left whole: `per_replica_gradients`
        return dtensor.relayout(piece, whole_over_batch(layout)), lambda dy: dy

    return gather(value)


# Set while `per_replica_gradients` traces a step: see there.
_PER_REPLICA = False


@contextlib.contextmanager
def per_replica_gradients():
    """Traces the per-layer gathers for a step that forms each replica's own gradient
    (`tf.vectorized_map` over the batch reshaped `[data_parallel, m, ...]`, as
    `tfpar.layout.reduction`): a gather's gradient is handed back whole, not reduced onto
    the piece (`tfpar.zero.reduce_scatter` reduce-scatters it, compressed), and the
    gathers read no zero from the layer's input (`_after`: inside the map it would make
    every gather per replica; the gathered weights are the same for every replica)."""
    global _PER_REPLICA
    before, _PER_REPLICA = _PER_REPLICA, True
    try:
        yield
    finally:
        _PER_REPLICA = before


def _whole_int8(value, layout):
    """`value` (a piece split over `batch` by `layout`) whole over `batch`, gathered as
    int8 codes and per-row fp32 scales (see the module docstring)."""
    axis = list(layout.sharding_specs).index(BATCH)
    others = [i for i in range(len(layout.sharding_specs)) if i != axis]
    whole = whole_over_batch(layout)

    @tf.custom_gradient
    def gather(piece):
        x = tf.cast(piece, tf.float32)
        amax = tf.reduce_max(tf.abs(x), axis=others, keepdims=True)
        scale = tf.where(amax > 0, amax / codecs.INT8_MAX, tf.ones_like(amax))
        codes = tf.cast(tf.clip_by_value(tf.round(x / scale), -codecs.INT8_MAX,
                                         codecs.INT8_MAX), tf.int8)
        # The scales whole on every device: with tensor parallelism `whole` keeps `model`
        # on a dimension the max reduced to size 1, which DTensor cannot split.
        replicated = dtensor.Layout.replicated(layout.mesh, len(layout.sharding_specs))
        out = (tf.cast(dtensor.relayout(codes, whole), tf.float32)
               * dtensor.relayout(scale, replicated))

        def grad(dy):
            if _PER_REPLICA:
                return tf.cast(dy, piece.dtype)
            return dtensor.relayout_like(tf.cast(dy, piece.dtype), piece)

        return tf.cast(out, piece.dtype), grad

    return gather(value)


def _quantized(variable, codec):
    return codec == "int8" and len(variable.shape) >= 2


def device_share(variable, axes=None):
    """How many pieces `variable`'s layout cuts it into over the mesh axes `axes` (all
    its sharded axes if None): the whole over this is one device's part."""
    layout = dtensor.fetch_layout(getattr(variable, "value", variable))
    return math.prod(layout.mesh.dim_size(s) for s in layout.sharding_specs
                     if s != dtensor.UNSHARDED and (axes is None or s in axes))


def gather_bytes(model, passes=None):
    """Bytes each device hands to the per-layer weight gathers in one step (its piece of
    each weight, also split over `model` with tensor parallelism), from the weights
    `gather_per_layer` wrapped; 0 without any. `passes`: how often each layer's gather
    runs, 1 in a step traced under `per_replica_gradients` (no recomputation there); None:
    each layer's own, 2 (forward and the recomputed forward of the backward) or 1 without
    resharding (`gather_per_layer(reshard=False)`)."""
    total = 0
    for variable in model.trainable_variables:
        codec = getattr(variable, "_tfpar_gathered_per_layer", None)
        layout = _split_layout(variable)
        if not codec or layout is None:  # a weight kept whole is not gathered
            continue
        runs = passes or getattr(variable, "_tfpar_gather_passes", 2)
        shape = [int(d) for d in variable.shape]
        piece = math.prod(shape) // device_share(variable)
        if _quantized(variable, codec):  # its rows' scales: over `batch` only
            rows = shape[list(layout.sharding_specs).index(BATCH)]
            total += runs * (piece + 4 * rows // layout.mesh.dim_size(BATCH))
        else:
            total += runs * 4 * piece
    return total


def _after(value, inputs):
    """`value` + 0.0, the zero computed from `inputs`: `value`, exactly, but only once the
    layer's input exists (NaN if the input is NaN, as the layer's output would be)."""
    if not inputs or _PER_REPLICA:
        return value
    probe = tf.reduce_max(tf.cast(inputs[0], tf.float32))
    zero = tf.where(probe == probe, 0.0, float("nan"))
    return value + tf.cast(zero, value.dtype)


def kept_layers(sizes, keep_last=-1):
    """How many of the gathering layers, counted back from the last the forward pass runs,
    `--zero_keep_last_layers=keep_last` keeps whole from forward to backward. `sizes`: each
    gathering layer's parameter count, in call order. `keep_last >= 0`: that many (all if
    fewer); -1: the last layer at least as large as the median gathering layer (the upper
    one) and every layer after it, e.g. the zoo transformer's last block with `ln_f` and
    `lm_head` (torchtitan's default: its last block and output layers not resharded)."""
    if keep_last >= 0:
        return min(keep_last, len(sizes))
    if not sizes:
        return 0
    median = sorted(sizes)[len(sizes) // 2]  # one of the sizes: some layer reaches it
    return next(kept for kept, size in enumerate(reversed(sizes), 1) if size >= median)


def gather_per_layer(model, codec="fp32", prefetch=True, reshard=True, keep_last=0):
    """Makes every top-level layer of `model` whose weights are split over `batch` gather
    them whole just before it runs, and again in its backward pass (see the module
    docstring); returns the names of those layers. Marks the layers as recomputed
    (`tfpar.recompute` then leaves them alone: they already are, or with `reshard=False`
    keep everything for the backward) and their weights as gathered per layer (`gathered`
    leaves them split). `codec`: `"fp32"` or `"int8"` (`--zero_gather`). `prefetch`
    (`--zero_prefetch`): each gather is issued one layer early, forward and backward
    (`_prefetched`); the same values either way. `reshard=False`
    (`--nozero_reshard_after_forward`, FSDP's `reshard_after_forward=False`): each layer
    gathers once a step and keeps its whole weights and its activations for the backward
    pass, no recomputation (the gathers then wait for nothing: every whole weight is kept
    until its backward anyway); the same values. `keep_last` (`--zero_keep_last_layers`,
    `kept_layers`): with `reshard`, the last layers the forward pass runs are not
    resharded after it (FSDP's `reshard_after_forward=False` on them): gathered once a
    step, their whole weights and activations kept for the backward, which starts with
    them; the same values."""
    found = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer) or layer.non_trainable_weights:
            continue
        variables = list(layer.trainable_variables)
        layouts = [_split_layout(v) for v in variables]
        if all(layout is None for layout in layouts):
            continue
        found.append((layer, variables, layouts))
    if found:
        collective_gathers(next(l for l in found[0][2] if l is not None).mesh)
    kept = kept_layers([sum(math.prod(v.shape) for v in variables)
                        for _, variables, _ in found], keep_last) if reshard else 0
    names = []
    for i, (layer, variables, layouts) in enumerate(found):
        keep = not reshard or i >= len(found) - kept
        _wrap(layer, variables, layouts, codec, prefetch, reshard, keep)
        for variable in variables:
            object.__setattr__(variable, "_tfpar_gathered_per_layer", codec)
            object.__setattr__(variable, "_tfpar_gather_passes", 1 if keep else 2)
        object.__setattr__(layer, "_tfpar_kept_whole", keep)
        names.append(layer.name)
    return names


def _wrap(layer, variables, layouts, codec, prefetch, reshard, keep=False):
    call = layer.call
    quantized = [layout is not None and _quantized(v, codec)
                 for v, layout in zip(variables, layouts)]

    def gather(pieces):
        return [_whole_int8(p, layout) if q else _whole(v, p, layout)
                for v, p, layout, q in zip(variables, pieces, layouts, quantized)]

    @functools.wraps(call)
    def gathering_call(*args, **kwargs):
        # Under the step's StatelessScope `v.value` is this step's piece of the weight.
        pieces = [tf.cast(v.value, v.dtype) for v in variables]
        flat = tf.nest.flatten(args)
        # Only floating inputs go through recompute_grad (it watches them; token ids
        # have no gradient and would only be warned about); the rest stay captured.
        positions = [i for i, a in enumerate(flat) if tf.is_tensor(a) and a.dtype.is_floating]
        tensors = [flat[i] for i in positions]
        others = [a for a in flat if tf.is_tensor(a) and not a.dtype.is_floating]
        autocast = patches.autocast_scope()  # mixed precision: replayed in the backward

        def run(given, whole):
            values = list(flat)
            for i, tensor in zip(positions, given):
                values[i] = tensor
            mapping = list(zip(variables, whole))
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope, \
                    patches.autocasting(autocast):
                out = call(*tf.nest.pack_sequence_as(args, values), **kwargs)
            # What this scope of its own would drop: a write of the layer's weight (a clip
            # in `call`) or a loss term added in it (`add_loss`, an inner layer's activity
            # regularizer; under the recomputation its gradient would be lost too). Marked
            # on the layer for the step to refuse (`take_dropped`).
            written = [v.path for v, w in mapping if scope.get_current_value(v) is not w]
            if written or scope.losses:
                object.__setattr__(layer, "_tfpar_dropped", (written, len(scope.losses)))
            return out

        if _PER_REPLICA or not reshard:  # not recomputed (module docstring)
            return run(tensors, gather(pieces))
        if prefetch:
            return _prefetched(run, gather, tensors, pieces, tensors or others,
                               [layout is None for layout in layouts], keep)
        if keep:  # a tail layer kept whole: gathered once its input exists
            return run(tensors, gather([_after(p, list(tensors) or others) for p in pieces]))

        def forward(*inputs):
            given, own = inputs[:len(positions)], inputs[len(positions):]
            return run(given, gather([_after(p, list(given) or others) for p in own]))

        return tf.recompute_grad(forward)(*tensors, *pieces)

    object.__setattr__(layer, "call", gathering_call)
    object.__setattr__(layer, "_tfpar_recomputed", True)


def take_dropped(model):
    """`[(layer, written weight paths, losses added)]` of `model`'s per-layer gathering
    layers whose `call`, traced since the last take, wrote its own weight or added a loss
    term (both would be dropped by the layer's scope of its own); the marks cleared. Read
    while a step is traced, never per step."""
    out = []
    for layer in model.layers:
        dropped = getattr(layer, "_tfpar_dropped", None)
        if dropped:
            out.append((layer, *dropped))
            object.__setattr__(layer, "_tfpar_dropped", None)
    return out


class _Link:
    """One gathering layer's call in a traced graph, for its neighbours' prefetch:
    `zero` (0.0 computed from its input, None without one), `regather(zero)` (its
    weights whole again, once `zero` exists), `previous` (the gathering layer called just
    before it in the same forward pass), `prefetched` (its backward's whole weights, when
    the layer after it issued them), `done` (its backward was built), `kept` (its whole
    weights kept from its forward: nothing to regather)."""

    def __init__(self, graph, zero, regather, previous, kept=False):
        self.graph, self.zero, self.regather = graph, zero, regather
        self.previous, self.prefetched, self.done = previous, None, False
        self.kept = kept



_CHAIN = threading.local()  # `.last()`: the `_Link` of the latest gathering call traced


def _zero(tensor):
    """0.0 computed from `tensor` (NaN if it holds a NaN): a data dependency on it."""
    probe = tf.reduce_max(tf.cast(tensor, tf.float32))
    return tf.where(probe == probe, 0.0, float("nan"))


def _plus(values, zero):
    return [v + tf.cast(zero, v.dtype) for v in values]


def _prefetched(run, gather, tensors, pieces, probed, kept, keep=False):
    """`run(tensors, gather(pieces))` recomputed in the backward pass, as
    `tf.recompute_grad(forward)` (the same ops on the same values), with each gather
    issued one layer early: forward, this layer's gather waits on the previous gathering
    layer's input, not its own, so TensorFlow may run it beside the previous layer;
    backward, this layer regathers the previous layer's weights as soon as its own
    output's gradient exists, beside its own recomputation and backward. At most this
    layer's and the next one's weights are whole at a time. `kept[i]`: piece i is a
    weight kept whole (its gradient is the whole weight's), else the whole weight's
    gradient is relayouted onto it (`Relayout`'s gradient, and `_whole_int8`'s).
    `keep` (a tail layer, `--zero_keep_last_layers`): not recomputed; the forward's
    whole weights and activations serve the backward (its own tape's gradient), which
    still regathers the previous layer early."""
    graph = tf.compat.v1.get_default_graph()
    previous = getattr(_CHAIN, "last", lambda: None)()
    if previous is None or previous.graph is not graph or previous.done:
        previous = None  # another graph, or an earlier pass (micro-batch) already done
    own = _zero(probed[0]) if probed else None
    ready = previous.zero if previous is not None and previous.zero is not None else own
    link = _Link(graph, own, lambda zero: gather(_plus(pieces, zero)), previous, keep)
    _CHAIN.last = weakref.ref(link)  # the graph's gradient functions hold the links
    n = len(tensors)

    @tf.custom_gradient
    def recomputed(*args):
        given, own_pieces = list(args[:n]), list(args[n:])
        whole = gather(own_pieces if ready is None else _plus(own_pieces, ready))
        if keep:
            with tf.GradientTape() as kept_tape:
                kept_tape.watch(given + whole)
                kept_out = run(given, whole)

        def grad(*dys, variables=None):
            # The recomputation waits for the output's gradient, as tf.recompute_grad's.
            zero = _zero(tf.reshape(dys[0], [-1])[:1])
            link.done = True
            if (previous is not None and not previous.done and not previous.kept
                    and previous.prefetched is None):
                previous.prefetched = previous.regather(zero)
            extra = list(variables or [])
            if keep:
                grads = kept_tape.gradient(
                    kept_out, given + whole + extra, output_gradients=list(dys),
                    unconnected_gradients=tf.UnconnectedGradients.ZERO)
            else:
                whole_again = (link.prefetched if link.prefetched is not None
                               else link.regather(zero))
                link.prefetched = None
                inputs = _plus(given, zero)
                with tf.GradientTape() as tape:
                    tape.watch(inputs + whole_again + extra)
                    out = run(inputs, whole_again)
                grads = tape.gradient(out, inputs + whole_again + extra,
                                      output_gradients=list(dys),
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
            d_pieces = [g if whole_weight else
                        dtensor.relayout_like(tf.cast(g, p.dtype), p)
                        for g, p, whole_weight in zip(grads[n:n + len(own_pieces)],
                                                      own_pieces, kept)]
            if variables:
                return grads[:n] + d_pieces, grads[n + len(own_pieces):]
            return grads[:n] + d_pieces

        return (kept_out if keep else run(given, whole)), grad

    return recomputed(*tensors, *pieces)
