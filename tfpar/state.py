"""The training state under names that do not depend on the layout: saved whole, loaded
onto any layout.

A checkpoint of `tf.train.Checkpoint(model=..., optimizer=...)` follows the objects that
hold the state, so it restores only onto the layout that wrote it: a pipeline's stage
optimizers, ZeRO's flat pieces and a mesh's sharded variables are other objects. Here every
piece of state is named as in the single-device model and saved as one full tensor:

- `model/<path>`: a weight by its Keras path (`dense_0/kernel`), whole (a mesh's shards
  gathered, a pipeline stage's weights under their own paths, once for Chimera's two
  copies of a stage, loaded into both);
- `optimizer/<path>/<slot>`: an optimizer slot by its weight (`optimizer/dense_0/kernel/
  momentum`), whole (ZeRO 1/2's flat pieces cut back into shapes; a stage optimizer's slots
  under the same names as a single optimizer's; `--offload`'s host arrays likewise);
- `optimizer/<name>`: the optimizer's other variables (`iteration`, `learning_rate`,
  `nonfinite_steps`), one per run (every stage optimizer holds the same value); a
  `LossScaleOptimizer`'s own (`dynamic_scale`, `step_counter`, its `iteration`) under
  `optimizer/loss_scale/<name>`;
- tf_keras (`keras=2`) under the same names: `dense_0/kernel:0` as `model/dense_0/kernel`,
  its slots `m/<path>`, `v/<path>` as `optimizer/<path>/momentum`, `.../velocity`, its
  constant learning rate (outside its `variables`) as `optimizer/learning_rate`;
- `meta/layout`: a JSON line of the layout that wrote it (for `python -m tfpar.checkpoint
  inspect`; never read on load).

An aggregator's state (error-feedback residuals, PowerSGD's Q, `auto`'s ranks) is saved
beside it by the aggregator's own objects, whose names are its positions in the
trainable variables: residuals keep one row per replica and move to another replica count
with their sum kept (`tfpar.compression.aggregator.PerReplicaSlot`). A mesh's codecs
(`tfpar.layout.reduction`, every stage's in a mesh pipeline; ZeRO-3's compressed
reduce-scatter, `tfpar.zero.reduce_scatter`) are saved here instead:
`codec/<path>/residual` (`[replicas, ...]`, one row per `batch` replica; onto another
count replica 0 takes their sum, the others zero, as `PerReplicaSlot` does) and
`codec/<path>/powersgd_q`.

Loading reads the tensors by name (`tf.train.load_checkpoint`) and assigns each into the
variable of the running layout: onto a mesh through its layout (`tfpar.layout.values`), onto
ZeRO's pieces by re-cutting the flat vector for this replica count, onto a pipeline stage
on its device. The file is TensorFlow's checkpoint (a tensor bundle), so
`tf.train.load_checkpoint` reads it without tfpar.
"""

import json
import re

import numpy as np
import tensorflow as tf

from tfpar import patches
from tfpar.errors import TfparError

# Where `LayoutState`'s tensors sit in a `tf.train.Checkpoint(state=...)`: TensorFlow keys
# a trackable's own tensors `<object path>/.ATTRIBUTES/<name>`.
PREFIX = "state/.ATTRIBUTES/"
LAYOUT = "meta/layout"


def key(name):
    """The checkpoint key of state tensor `name` (TensorFlow escapes `/` in the names of a
    trackable's tensors)."""
    return PREFIX + name.replace("/", ".S").replace(".", "..")


def name_of(checkpoint_key):
    """The state tensor name of a checkpoint key (`key`'s inverse), or None."""
    if not checkpoint_key.startswith(PREFIX):
        return None
    return checkpoint_key[len(PREFIX):].replace("..", ".").replace(".S", "/")


# Optimizer variables a checkpoint may lack (kept at their start value): counters only;
# and a mesh codec's state (a run that turns a codec on owes no error yet).
_OPTIONAL = ("optimizer/nonfinite_steps",)
_OPTIONAL_PREFIX = "codec/"


def optimizers_of(model):
    """The optimizers holding `model`'s state: one per pipeline stage, or the one."""
    stages = getattr(model, "stage_optimizers", None)
    if stages:
        # A tf.distribute pipeline's compiled optimizer counts steps beside its stages'.
        counter = getattr(model, "optimizer", None)
        return [*stages, *([counter] if counter is not None else [])]
    optimizer = getattr(model, "optimizer", None)
    return [optimizer] if optimizer is not None else []


class LayoutState(patches.Trackable):
    """The state of `model` and its optimizers under canonical names (module docstring).

    Saved as `tf.train.Checkpoint(state=LayoutState(...))`; loaded with `load`.

    Args:
        model: the compiled model of any backend (a `PipelineModel`, a mesh's
            `StagedModel` with `stage_optimizers`, a model on a mesh or a strategy).
        layout: what to record as the writer's layout (a JSON-able dict).
    """

    def __init__(self, model, layout=None):
        self._model = model
        self._layout = layout or {}

    @property
    def model(self):
        """The model whose state this is."""
        return self._model

    def entries(self):
        """`{name: (read, write, shape)}`: `read()` gives the full value as numpy,
        `write(array)` puts a full value into this layout, `shape` is the full value's."""
        weights = {}
        # Chimera's second copy of each stage (`PipelineModel.copied_weights`): saved once,
        # loaded into both copies.
        copied = {id(w) for w in getattr(self._model, "copied_weights", lambda: [])()}
        for w in self._model.weights:
            other = weights.setdefault(_path(w), [w])
            if other[0] is w:
                continue
            if id(w) not in copied:  # two weights under one name: a checkpoint holds one
                raise TfparError(f"two weights of the model are named {_path(w)!r}: a "
                                 "checkpoint names each weight by its path; give the layers "
                                 "distinct names")
            other.append(w)
        out = {}
        for path, copies in weights.items():
            for w in copies:
                out[f"model/{path}"] = _merge(out.get(f"model/{path}"), _plain(w))
        for optimizer in optimizers_of(self._model):
            for name, entry in _optimizer_entries(optimizer,
                                                  self._model.trainable_weights).items():
                out[name] = _merge(out.get(name), entry)
        for reduction in getattr(self._model, "tfpar_reductions", ()):
            for name, (variable, per_replica) in reduction.named_state().items():
                out[f"codec/{name}"] = (_per_replica(variable) if per_replica
                                        else _plain(variable))
        return out

    # TensorFlow's checkpoint protocol: registry entry `trackable_tensors` of tfpar.patches.
    def _serialize_to_tensors(self):
        tensors = {name: tf.constant(e[0]()) for name, e in self.entries().items()}
        tensors[LAYOUT] = tf.constant(json.dumps(self._layout, sort_keys=True))
        return tensors

    def _restore_from_tensors(self, restored_tensors):
        raise TypeError("load a LayoutState with LayoutState.load, which maps names onto "
                        "this layout")

    def load(self, path, only=""):
        """Assigns every state tensor of checkpoint `path` (whose name starts with `only`:
        `"model/"` for the weights alone) into this layout.

        Raises:
            ValueError: `path` has no state under these names (another model, or a
                checkpoint of before this format), or a tensor's shape differs.
        """
        reader = tf.train.load_checkpoint(path)
        saved = {name_of(k) for k in reader.get_variable_to_shape_map()} - {None}
        entries = {k: v for k, v in self.entries().items() if k.startswith(only)}
        # A codec's state is optional where the checkpoint holds none of its kind (written
        # without that codec); where it holds some, a name it lacks is a mismatch, not an
        # error owed of zero.
        kinds = {n.rsplit("/", 1)[-1] for n in saved if n.startswith(_OPTIONAL_PREFIX)}
        missing = sorted(n for n in set(entries) - saved - set(_OPTIONAL)
                         if not (n.startswith(_OPTIONAL_PREFIX)
                                 and n.rsplit("/", 1)[-1] not in kinds))
        if missing:
            raise ValueError(f"no {missing[0]} in it" + (
                f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
        for name, (_, write, want) in entries.items():
            if name not in saved:
                continue
            value = reader.get_tensor(key(name))
            if not _fits(value.shape, want):
                raise ValueError(f"{name} is {list(value.shape)} there, {list(want)} here")
            write(value)


def load(path, layout_state, others):
    """Loads checkpoint `path`: `layout_state` (a `LayoutState`) by name, `others` (a dict
    of trackables saved beside it: the step, aggregators) by TensorFlow's restore.

    A checkpoint written before this format (the model's and optimizer's object graph)
    restores only onto the layout that wrote it, as it did then.

    Raises:
        ValueError, AssertionError: the checkpoint does not hold this model's state.
    """
    reader = tf.train.load_checkpoint(path)
    if not reader.has_tensor(key(LAYOUT)):
        model = layout_state.model
        tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                            step=others["step"]).restore(path).assert_existing_objects_matched()
        return
    layout_state.load(path)
    tf.train.Checkpoint(**others).restore(path).expect_partial().assert_existing_objects_matched()


def aggregators_of(model):
    """`{name: aggregator}` of the tfpar gradient aggregators of `model`'s optimizers (saved
    with their own objects beside the `LayoutState`)."""
    from tfpar.compression import keras_hook
    # An aggregator with no state a step reads (fp32 buckets: `checkpointed` False) is
    # left out, so its checkpoints load where Keras's own all-reduce ran and the reverse.
    found = [a for a in map(keras_hook.aggregator_of, optimizers_of(model))
             if a is not None and a.checkpointed]
    out = ({"aggregator": found[0]} if len(found) == 1
           else {f"aggregator_{i}": a for i, a in enumerate(found)})
    # ZeRO 1/2 with a codec keeps its error feedback per replica beside its pieces
    # (`tfpar.zero.sharded`): saved the same way, its sum kept across replica counts.
    from tfpar.zero import sharded
    residuals = [getattr(sharded.zero_of(o), "tfpar_zero_residual", None)
                 for o in optimizers_of(model)]
    residuals = [r for r in residuals if r is not None]
    if len(residuals) == 1:
        out["zero_residual"] = residuals[0]
    else:
        out.update({f"zero_residual_{i}": r for i, r in enumerate(residuals)})
    return out


def layout_of(config, runtime):
    """The layout a run writes with (`meta/layout`): backend, degrees, ZeRO stage, world."""
    from tfpar import compat
    out = {"workers": getattr(runtime, "workers", 1),
           "replicas": getattr(runtime, "replicas", 1)}
    dims = getattr(config, "dims", None)
    if dims is not None:
        out.update(backend=compat.backend_of(config), data_parallel=dims.dp,
                   tensor_parallel=dims.tp, pipeline_stages=dims.pp,
                   zero_stage=config.zero_stage, keras=config.keras)
    return out


def read_layout(path):
    """The layout recorded by the checkpoint `path` (a dict; empty if none)."""
    reader = tf.train.load_checkpoint(path)
    if not reader.has_tensor(key(LAYOUT)):
        return {}
    return json.loads(reader.get_tensor(key(LAYOUT)).decode())


def tensors_of(path):
    """`{name: numpy array}` of every state tensor of checkpoint `path` (no layout)."""
    reader = tf.train.load_checkpoint(path)
    names = {name_of(k): k for k in reader.get_variable_to_shape_map()}
    names.pop(None, None)
    names.pop(LAYOUT, None)
    return {name: reader.get_tensor(k) for name, k in sorted(names.items())}


def _plain(variable):
    """(read, write, shape) of a variable: mirrored, on a stage's device, or on a mesh."""
    from tensorflow.experimental import dtensor

    from tfpar.layout import values

    tf_variable = variable if isinstance(variable, tf.Variable) else variable.value

    def write(array):
        if dtensor.is_dtensor(tf_variable.read_value()):
            values.assign(tf_variable, array)
        else:
            tf_variable.assign(np.asarray(array, tf_variable.dtype.as_numpy_dtype))
    return (lambda: values.to_host(tf_variable)), write, tuple(tf_variable.shape)


def _fits(shape, want):
    """A saved shape fits `want`, whose None dimensions take any size."""
    return len(shape) == len(want) and all(w is None or int(d) == w
                                           for d, w in zip(shape, want))


def _per_replica(variable):
    """(read, write, shape) of a mesh codec's residual `[replicas, ...]`: rows saved as they
    are; written onto another replica count, replica 0 takes the saved rows' sum and the
    others zero (the error still owed kept exactly, as `PerReplicaSlot` keeps it)."""
    read, write, shape = _plain(variable)

    def write_rows(array):
        array = np.asarray(array)
        if array.shape[0] != shape[0]:
            rows = np.zeros(shape, array.dtype)
            rows[0] = array.sum(0)
            array = rows
        write(array)
    return read, write_rows, (None,) + tuple(shape[1:])


def _merge(first, entry):
    """One name held by several optimizers (a stage optimizer's `iteration`): read the
    first, write all."""
    if first is None:
        return entry

    def write(array):
        first[1](array)
        entry[1](array)
    return first[0], write, first[2]


def _optimizer_entries(optimizer, trainable):
    """The canonical entries of one Keras optimizer of the weights `trainable` (ZeRO's
    pieces included)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        # A LossScaleOptimizer: the inner optimizer's state under the plain names, the
        # wrapper's own (its scale, its counters) under `optimizer/loss_scale/`.
        out = _optimizer_entries(inner, trainable)
        held = {id(v) for v in inner.variables}
        for v in optimizer.variables:
            if id(v) not in held:
                out[f"optimizer/loss_scale/{v.name}"] = _plain(v)
        return out
    paths = {_path(w) for w in trainable}
    out = {}
    for v in optimizer.variables:
        own = _own_name(v)  # without the optimizer's name (a stage's `adam_1`)
        slot = _slot_of(own, paths)
        name = f"optimizer/{slot[0]}/{slot[1]}" if slot else f"optimizer/{own}"
        out[name] = _merge(out.get(name), _plain(v))
    tf_keras_optimizer = type(optimizer).__module__.startswith("tf_keras")
    if tf_keras_optimizer and "optimizer/learning_rate" not in out:
        # tf_keras keeps a constant learning rate outside `variables`; Keras 3 within.
        rate = optimizer.learning_rate
        if isinstance(rate, tf.Variable):
            out["optimizer/learning_rate"] = _plain(rate)
    from tfpar import offload
    from tfpar.zero import sharded
    for weight, slot, entry in (sharded.slot_entries(optimizer, trainable)
                                + offload.slot_entries(optimizer, trainable)):
        out[f"optimizer/{_path(weight)}/{slot}"] = entry
    return out


def _path(variable):
    """A Keras variable's path (`dense_0/kernel`); a tf_keras variable's name without its
    `:0`."""
    path = getattr(variable, "path", None)
    return path if path is not None else _own_name(variable)


def _own_name(variable):
    """A variable's name without TensorFlow's output index (tf_keras's `iteration:0`)."""
    name = variable.name
    return name.rsplit(":", 1)[0] if re.fullmatch(r".*:\d+", name) else name


# tf_keras's slot names (`m/<weight>`, `v/<weight>`) as Keras 3 names the same slots.
_TF_KERAS_SLOTS = {"m": "momentum", "v": "velocity"}


def _slot_of(name, paths):
    """`(weight path, slot)` of an optimizer slot variable named `name`, or None: Keras 3
    names a slot `<path with _>_<slot>` (the longest weight that prefixes it wins), tf_keras
    `<slot>/<path>` (its `m` and `v` named as Keras 3's `momentum` and `velocity`)."""
    slot, _, path = name.partition("/")
    if path in paths:
        return path, _TF_KERAS_SLOTS.get(slot, slot)
    best = None
    for path in paths:
        prefix = path.replace("/", "_") + "_"
        if name.startswith(prefix) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, path)
    return (best[1], name[len(best[0]):]) if best else None
