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

- `codec/<path>/<kind>`: a gradient codec's state by the weight it belongs to, under one
  set of names on every backend: tf.distribute's aggregators (`tfpar.compression`,
  `Aggregator.named_state`), a mesh's codecs (`tfpar.layout.reduction`, every stage's in a
  mesh pipeline; `tfpar.layout.auto`; ZeRO-3's compressed reduce-scatter,
  `tfpar.zero.reduce_scatter`; ZeRO 1/2's, `tfpar.zero.sharded`: its reduce-scatter's
  flat residual cut per weight, or its aggregator's state). A per-replica kind holds one
  row per replica (`[replicas, ...]`): `residual` (a debt: onto another replica count replica 0 takes what
  the rows owe, the others zero), DGC's `dgc_velocity` (replica 0 takes the rows' sum),
  Adam's `adam_m`, `adam_v` in front of compression (estimates: every replica takes their
  mean). A mesh's residual row is its replica's own error (the step applies their mean),
  tf.distribute's and ZeRO 1/2's its share (Keras divided the gradient by the replicas:
  their sum):
  `meta/residual_units` says which, and a load converts. The others are the same on
  every replica: `powersgd_q`, `auto`'s `auto_rank`, `auto_norm_sum`, ... and a codec's
  counters under its first weight's path (`step`, `auto_step`, `auto_bytes_total`). Adam
  in front of a mesh codec (`tfpar.layout.adam_front`) holds the same kinds as
  tf.distribute's (`step`, `adam_m`, `adam_v`, rows saved even where the mesh keeps one
  value for every replica). A checkpoint written on one backend so resumes on the other:
  a kind the running codec has no place for (tf.distribute's `step` on a mesh codec) is
  named in one line and not loaded (Adam in front's moments and counter go into Keras's
  Adam slots where Adam runs behind the codec: `meta/adam_moments` below); a kind the
  checkpoint lacks starts at its initial value, said in one line, except a missing
  `step` counter, which takes the update count (`meta/accumulation` below).
- `meta/adam_moments`: with Adam in front of a codec, what its moments hold (a JSON line,
  `adam_front.moment_units`: `m` in the gradient's units or Adam's scaled ones, the step
  count of `v`'s bias correction, the betas; `takes_steps`: whether the fronts took the
  steps, not on one replica, where Keras's Adam did). Loaded where Keras's Adam keeps the
  moments (Adam behind the codec, no codec, one replica), the rows are carried into
  Keras's `momentum`/`velocity` slots at the checkpoint's update count with the same
  bias-corrected estimates (`adam_front.keras_slots`; Keras's own slots of such a run
  hold zeros); the reverse, Keras's slots into Adam in front (`adam_front.front_moments`),
  its counter set to the update count: from a checkpoint of Keras's Adam, or of fronts
  that did not take the steps (their moments zero, Keras's slots holding Adam's). An
  older record, without `takes_steps`, is guessed from its steps: 0, the fronts did not
  step; more, they did (said in one line where its steps fall short of the update count:
  fronts that stepped part of the run, or a guess to check). Without the record the
  moments are named in one line and Keras's Adam takes the checkpoint's own slots, as
  before the record existed.
- `meta/accumulation`: the writer's `gradient_accumulation_steps` K (1 without). The
  update count is `optimizer/iteration` (micro-batches) // the writer's K: what the
  moments above were bias-corrected with and a codec's step counter counted (a checkpoint
  without it: this run's K). Read with another K, `optimizer/iteration` is set to the
  update count × this run's K (said in one line), where Keras's Adam continues at the
  update count; a checkpoint of K 1 owes no gradient accumulators.

On one replica nothing is compressed, so no step would send a debt loaded from more
replicas: tf.distribute's aggregator (and ZeRO 1/2's) pays its residuals, their sum, into
the next applied step's gradient once (`keras_hook.pay_debt`: a step skipped for
non-finite gradients leaves the debt to the next), as ZeRO's own flat residual is.

A checkpoint of an older tfpar holds tf.distribute's aggregator state as its objects
(`aggregator/residual_slots/<position>`, `aggregator/qs/<position>`, ...: positions among
the trainable variables; ZeRO 1/2's aggregator as `zero_residual/...`): read under the
names above. Such a key that names nothing here (ZeRO's flat `zero_residual`, another
model's position) is named in one line and not loaded.

Loading reads the tensors by name (`tf.train.load_checkpoint`) and assigns each into the
variable of the running layout: onto a mesh through its layout (`tfpar.layout.values`), onto
ZeRO's pieces by re-cutting the flat vector for this replica count, onto a pipeline stage
on its device. The file is TensorFlow's checkpoint (a tensor bundle), so
`tf.train.load_checkpoint` reads it without tfpar.
"""

import json
import os
import re

import numpy as np
import tensorflow as tf
from absl import logging

from tfpar import patches
from tfpar.errors import TfparError

# Where `LayoutState`'s tensors sit in a `tf.train.Checkpoint(state=...)`: TensorFlow keys
# a trackable's own tensors `<object path>/.ATTRIBUTES/<name>`.
PREFIX = "state/.ATTRIBUTES/"
LAYOUT = "meta/layout"
# What a `residual` row holds (module docstring): "replica", each replica's own error in
# its own gradient's units (a mesh's codecs); "share", its share of what the sum owes
# (tf.distribute's aggregators: Keras divided the gradient by the replicas).
UNITS = "meta/residual_units"
# What Adam in front of a codec holds in its moments (`adam_front.moment_units`: `m` in the
# gradient's or Adam's scaled units, `v`'s bias-correction count, the betas): a JSON line.
ADAM_UNITS = "meta/adam_moments"
# The writer's `gradient_accumulation_steps` K (1 without): `optimizer/iteration` counts
# micro-batches, so the updates it stands for are iteration // K of the writer's K.
ACCUMULATION = "meta/accumulation"


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
# and a codec's state (a run that turns a codec on owes no error yet).
_OPTIONAL = ("optimizer/nonfinite_steps",)
_OPTIONAL_PREFIX = "codec/"
# A codec's step counters: one a checkpoint lacks takes the optimizer's `iteration`.
_STEP_KINDS = ("step", "auto_step")
# Codec state a checkpoint may lack beside others of its kind.
_NOT_OWED = (*_STEP_KINDS, "residual")


def optimizers_of(model):
    """The optimizers holding `model`'s state: one per pipeline stage, or the one."""
    stages = getattr(model, "stage_optimizers", None)
    if stages:
        # A tf.distribute pipeline's compiled optimizer counts steps beside its stages'.
        counter = getattr(model, "optimizer", None)
        return [*stages, *([counter] if counter is not None else [])]
    optimizer = getattr(model, "optimizer", None)
    return [optimizer] if optimizer is not None else []


def accumulation_of(model):
    """`model`'s optimizer's `gradient_accumulation_steps` K (1 without)."""
    found = optimizers_of(model)
    optimizer = getattr(found[0], "inner_optimizer", found[0]) if found else None
    return max(1, int(getattr(optimizer, "gradient_accumulation_steps", None) or 1))


def _update_steps(model, iteration, reader=None):
    """The updates `optimizer/iteration` (Keras's raw count, of micro-batches under its
    `gradient_accumulation_steps` K) stands for: iteration // K, what Keras's Adam
    bias-corrected with and a codec's step counter counted, K the writer's
    (`meta/accumulation` of `reader`'s checkpoint; this run's for a checkpoint without
    it). (Keras's own `iterations` divides by this run's K.)"""
    written = reader is not None and reader.has_tensor(key(ACCUMULATION))
    accumulation = (int(reader.get_tensor(key(ACCUMULATION))) if written
                    else accumulation_of(model))
    return int(iteration) // max(1, accumulation)


def _rescale_iteration(model, reader, saved, entries, path):
    """Keras's raw `optimizer/iteration` counts micro-batches of its K: a checkpoint of
    another K (`meta/accumulation`) takes its updates × this run's K, so that Keras's Adam
    (`iterations` = raw // K) bias-corrects at the updates the moments hold, and a learning
    rate schedule (Keras reads the raw count) sees what a run of this K would have. A
    checkpoint without the record is read at this run's K."""
    if ("optimizer/iteration" not in entries or "optimizer/iteration" not in saved
            or not reader.has_tensor(key(ACCUMULATION))):
        return
    written, here = int(reader.get_tensor(key(ACCUMULATION))), accumulation_of(model)
    if written == here:
        return
    raw = int(reader.get_tensor(saved["optimizer/iteration"]))
    updates = raw // max(1, written)
    entries["optimizer/iteration"][1](np.int64(updates * here))
    logging.warning("tfpar: checkpoint %s: written with gradient_accumulation_steps %d, "
                    "read with %d: optimizer/iteration %d (%d updates) set to %d%s",
                    os.path.basename(path), written, here, raw, updates, updates * here,
                    " (its unfinished accumulation of %d micro-batches kept in Keras's "
                    "accumulators)" % (raw % written) if raw % written else "")


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
        self._units = {}  # residual name -> what its rows hold (`UNITS`)
        for reduction in getattr(self._model, "tfpar_reductions", ()):
            written = getattr(reduction, "state_written", None)
            for name, (variable, per_replica) in reduction.named_state().items():
                entry = (
                    _mean_rows(variable, reduction.replicas, per_replica == "mean_rows")
                    if per_replica in ("mean_rows", "mean_whole")
                    else _per_replica(variable) if per_replica else _plain(variable))
                out[f"codec/{name}"] = _then(entry, written) if written else entry
                if _kind(name) == "residual":
                    self._units[f"codec/{name}"] = "replica"
        for name, (entry, rows) in _aggregator_entries(self._model).items():
            out[f"codec/{name}"] = _merge(out.get(f"codec/{name}"), entry)
            if rows == "residual":
                self._units[f"codec/{name}"] = "share"
        from tfpar.zero import sharded
        for optimizer in optimizers_of(self._model):
            for weight, entry in sharded.residual_entries(optimizer,
                                                          self._model.trainable_weights):
                out[f"codec/{_path(weight)}/residual"] = entry
                self._units[f"codec/{_path(weight)}/residual"] = "share"
        return out

    # TensorFlow's checkpoint protocol: registry entry `trackable_tensors` of tfpar.patches.
    def _serialize_to_tensors(self):
        # A variable of `_plain` (not on a mesh) as TensorFlow saves its own: its read
        # deferred to the checkpoint's (`snapshot` reads them all in one function), no
        # copy (a read keeps its values while training updates the variable); the others
        # (gathered, rows, DTensor) as numpy, now.
        tensors = {name: (patches.tensorflow_checkpoint.deferred_read(e[0].variable)
                          if getattr(e[0], "variable", None) is not None
                          else tf.constant(e[0]()))
                   for name, e in self.entries().items()}
        tensors[LAYOUT] = tf.constant(json.dumps(self._layout, sort_keys=True))
        units = set(self._units.values())
        if len(units) == 1:
            tensors[UNITS] = tf.constant(units.pop())
        fronts = _fronts(self._model)
        if fronts:  # (every stage's front takes the same steps: the first one's record)
            # Whether the fronts took the steps: not on one replica, where Keras's Adam did
            # and its slots hold the moments (a reader with fronts that step takes them).
            record = {**fronts[0](), "takes_steps": bool(fronts[0].steps)}
            tensors[ADAM_UNITS] = tf.constant(json.dumps(record, sort_keys=True))
        tensors[ACCUMULATION] = tf.constant(accumulation_of(self._model), tf.int64)
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
        saved = {name_of(k): k for k in reader.get_variable_to_shape_map()}
        saved.pop(None, None)
        unmapped = []
        saved.update(_old_aggregator_names(reader, self._model, unmapped))
        if unmapped:
            logging.warning("tfpar: checkpoint %s holds an older tfpar's codec state that "
                            "names nothing in this run, not loaded: %s",
                            os.path.basename(path), ", ".join(sorted(unmapped)))
        entries = {k: v for k, v in self.entries().items() if k.startswith(only)}
        # A codec's state is optional where the checkpoint holds none of its kind (written
        # without that codec, or by a codec without that kind) and for a residual (the
        # writer's codec sent that tensor exactly: PowerSGD's vectors on tf.distribute);
        # otherwise a name it lacks is a mismatch. A step counter is never owed.
        kinds = {_kind(n) for n in saved if n.startswith(_OPTIONAL_PREFIX)}
        # Keras's gradient accumulators (this run's K > 1) are zero at an update: a
        # checkpoint written without accumulation (its record: K 1) owes none.
        unaccumulated = (reader.has_tensor(key(ACCUMULATION))
                         and int(reader.get_tensor(key(ACCUMULATION))) == 1)
        missing = sorted(n for n in set(entries) - set(saved) - set(_OPTIONAL)
                         if not (unaccumulated and n.endswith("/gradient_accumulator"))
                         and not (n.startswith(_OPTIONAL_PREFIX)
                                 and (_kind(n) not in kinds or _kind(n) in _NOT_OWED)))
        if missing:
            raise ValueError(f"no {missing[0]} in it" + (
                f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
        units = (reader.get_tensor(key(UNITS)).decode() if reader.has_tensor(key(UNITS))
                 else None)
        for name, (_, write, want) in entries.items():
            if name not in saved:
                continue
            value = reader.get_tensor(saved[name])
            if not _fits(value.shape, want):
                raise ValueError(f"{name} is {list(value.shape)} there, {list(want)} here")
            if name in self._units:
                # Older checkpoints: tf.distribute's rows in its aggregator's objects, a
                # mesh's under these names.
                written = units or ("share" if saved[name] != key(name) else "replica")
                value = _convert_rows(value, written, self._units[name])
            write(value)
        _rescale_iteration(self._model, reader, saved, entries, path)
        if _OPTIONAL_PREFIX.startswith(only):
            placed = self._adam_moves(reader, saved, entries, path)
            self._codec_moves(reader, saved, entries, path, kinds, placed)
            _owe_on_one_replica(self._model, path)

    def _adam_moves(self, reader, saved, entries, path):
        """Adam's moments between Adam in front of a codec and Keras's Adam (module
        docstring), each way; returns the codec state names it placed."""
        from tfpar.compression import adam_front
        name = os.path.basename(path)
        fronts = _fronts(self._model)
        # A destination whose fronts do not take the steps (one replica: Keras's Adam does)
        # counts as Keras's Adam, though its aggregator holds moments.
        held = _front_paths(saved)
        here = _front_paths(entries) if fronts and fronts[0].steps else set()
        record = (json.loads(reader.get_tensor(key(ADAM_UNITS)).decode())
                  if reader.has_tensor(key(ADAM_UNITS)) else None)
        placed, untaken = set(), set()
        if (held and record is not None and "takes_steps" not in record
                and "optimizer/iteration" in saved):
            updates = _update_steps(self._model, reader.get_tensor(saved["optimizer/iteration"]),
                                    reader)
            if 0 < record["steps"] < updates:
                logging.warning("tfpar: checkpoint %s: its record of Adam in front of the codec "
                                "predates takes_steps; guessed from its %d steps that the fronts "
                                "took the steps, though the update count is %d", name,
                                record["steps"], updates)
        if held and record is not None and not record.get("takes_steps", record["steps"] > 0):
            # The writer's fronts never stepped (one replica: Keras's Adam did, its slots
            # hold the moments; an older record says so by 0 steps): read as Keras's Adam's.
            untaken, held = held, set()
            placed = {n for n in saved if _owner(n) in untaken
                      and _kind(n) in ("adam_m", "adam_v", "step")}
        slots = ("momentum", "velocity")
        to_keras = sorted(p for p in held - here
                          if all(f"optimizer/{p}/{s}" in entries for s in slots))
        to_front = sorted(p for p in here - held
                          if all(f"optimizer/{p}/{s}" in saved for s in slots))
        if not (to_keras or to_front) or "optimizer/iteration" not in saved:
            return placed
        iteration = _update_steps(self._model, reader.get_tensor(saved["optimizer/iteration"]),
                                  reader)
        if to_keras and record is None:
            logging.warning("tfpar: checkpoint %s holds the moments of Adam in front of its "
                            "codec without the record of their units (%s): not loaded, "
                            "Keras's Adam takes the checkpoint's own slots", name, ADAM_UNITS)
        elif to_keras:
            for p in to_keras:
                rows = [np.asarray(reader.get_tensor(saved[f"codec/{p}/adam_{k}"]), np.float64)
                        for k in ("m", "v")]
                placed |= {f"codec/{p}/adam_m", f"codec/{p}/adam_v"}
                for slot, value in zip(slots, adam_front.keras_slots(*rows, record, iteration)):
                    entries[f"optimizer/{p}/{slot}"][1](value.astype(np.float32))
            placed |= {n for n in saved if _kind(n) == "step" and _owner(n) in held}
            logging.warning("tfpar: checkpoint %s: the moments of Adam in front of its codec "
                            "(m in %s units, after %d steps) carried into Keras's Adam slots "
                            "at iteration %d", name, record["m"], record["steps"], iteration)
        if to_front and fronts:
            units = fronts[0](iteration)
            for p in to_front:
                m, v = adam_front.front_moments(
                    *(np.asarray(reader.get_tensor(saved[f"optimizer/{p}/{s}"]), np.float64)
                      for s in slots), units, iteration)
                for k, value in (("m", m), ("v", v)):
                    entries[f"codec/{p}/adam_{k}"][1](value[None].astype(np.float32))
                    placed.add(f"codec/{p}/adam_{k}")
                if fronts[0].steps:  # Keras's slots of a run whose front steps hold zeros
                    for s in slots:
                        entries[f"optimizer/{p}/{s}"][1](np.zeros_like(m, np.float32))
            for n in entries:  # the front's counter takes the optimizer's iteration
                if (_kind(n) == "step" and _owner(n) in here
                        and (n not in saved or _owner(n) in untaken)):
                    entries[n][1](np.int64(iteration))
                    placed.add(n)
            logging.warning("tfpar: checkpoint %s: Keras's Adam slots at iteration %d carried "
                         "into Adam in front of this run's codec (m in %s units)", name,
                         iteration, units["m"])
        _drop_moved_residuals(entries, to_keras + to_front, name)
        return placed

    def _codec_moves(self, reader, saved, entries, path, kinds, placed=()):
        """After a load: says in one line each what codec state did not move as it is (a
        kind with no place here, a kind the checkpoint lacks; names in `placed`, moved by
        `_adam_moves`, aside) and sets a step counter the checkpoint lacks from the
        optimizer's `iteration`."""
        name = os.path.basename(path)
        # (An all-zero residual owes nothing: a mesh's PowerSGD keeps one for its vectors.)
        unplaced = [n for n in saved if n.startswith(_OPTIONAL_PREFIX) and n not in entries
                    and n not in placed
                    and not (_kind(n) == "residual" and not reader.get_tensor(saved[n]).any())]
        if unplaced:
            logging.warning("tfpar: checkpoint %s holds codec state this run's codec has no "
                            "place for, not loaded: %s", name, _count_kinds(unplaced))
        fresh = [n for n in entries if n.startswith(_OPTIONAL_PREFIX) and n not in saved
                 and n not in placed and not (_kind(n) == "residual" and _kind(n) in kinds)]
        steps = [n for n in fresh if _kind(n) in _STEP_KINDS]
        # Adam in front without its moments in the checkpoint (written with Adam behind the
        # codec): its counter stays at 0, so it redoes the exact warm-up that builds them;
        # past the warm-up zero moments would give steps many times Adam's.
        if steps and any(_kind(n) in ("adam_m", "adam_v") for n in fresh):
            logging.warning("tfpar: checkpoint %s has no Adam moments of this run's Adam in "
                            "front of its codec: its step counter starts at 0, the exact "
                            "warm-up runs again", name)
            fresh = [n for n in fresh if n not in steps]
        elif steps and "optimizer/iteration" in saved:
            iteration = np.int64(_update_steps(
                self._model, reader.get_tensor(saved["optimizer/iteration"]), reader))
            for n in steps:
                entries[n][1](iteration)
            logging.warning("tfpar: checkpoint %s has no step counter of this run's codec "
                            "(%s): set to the optimizer's iteration, %d", name,
                            ", ".join(sorted(steps)), int(iteration))
            fresh = [n for n in fresh if n not in steps]
        if fresh:
            logging.warning("tfpar: checkpoint %s holds no codec state of kind %s: it "
                            "starts at its initial value", name, _count_kinds(fresh))


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
    """`{name: trackable}` saved beside the `LayoutState` by TensorFlow's object graph:
    none now, every codec's state is in the `LayoutState` (`codec/...`, read in the step).
    An older tfpar saved tf.distribute's aggregators and ZeRO 1/2's error feedback here
    (`_old_aggregator_names` reads them); tests write that form by handing them back."""
    del model
    return {}


def _aggregators(model):
    """The tfpar aggregators of `model`'s optimizers whose state a step reads, each once,
    in the order older checkpoints named them (`aggregator`, or `aggregator_<i>`)."""
    from tfpar.compression import keras_hook
    from tfpar.zero import sharded
    # An aggregator with no state a step reads (fp32 buckets: `checkpointed` False) is
    # left out, so its checkpoints load where Keras's own all-reduce ran and the reverse.
    # ZeRO 1/2's (threshold, PowerSGD) is data parallelism's, under the same names.
    found = []
    for a in (keras_hook.aggregator_of(o) or sharded.aggregator_of(o)
              for o in optimizers_of(model)):
        if a is not None and a.checkpointed and all(a is not b for b in found):
            found.append(a)
    return ({"aggregator": found[0]} if len(found) == 1
            else {f"aggregator_{i}": a for i, a in enumerate(found)})


def _positions(aggregator, model):
    """`{position: weight path}` of a built `aggregator`'s variables among `model`'s."""
    paths = {}
    # Every weight, not only the trainable ones: a layer frozen after the aggregator was
    # built still names its state.
    for w in model.weights:
        position = aggregator.position_of(w)
        if position is not None:
            paths.setdefault(position, _path(w))
    if len(paths) != aggregator.positions:
        raise TfparError(f"{type(aggregator).__name__} was built for "
                         f"{aggregator.positions} variables, {len(paths)} of them the model's: "
                         "a checkpoint names its state by the model's weights")
    return paths


def _aggregator_entries(model):
    """`{name: ((read, write, shape), rows)}` of tf.distribute aggregators' state (module
    docstring: `codec/<path>/<kind>` without `codec/`; `rows` as `named_state`'s)."""
    out = {}
    for aggregator in _aggregators(model).values():
        # Not built on a mesh (the codec runs in the mesh's step instead); built for no
        # variable as a pipeline's step counter's optimizer: no state a step reads.
        if not aggregator.positions:
            continue
        for name, (variable, rows) in aggregator.named_state(
                _positions(aggregator, model)).items():
            entry = (_replica_rows(variable, rows == "mean") if rows
                     else _same_on_replicas(variable))
            out[name] = (_merge(out.get(name, (None,))[0], entry), rows)
    return out


# Older checkpoints' aggregator objects (`aggregator/<attribute>[/<position>]`) and the
# kind each holds; `moment_slots/m_<position>` and `v_<position>` are Adam's `adam_m`,
# `adam_v`; `wire_bytes` (the last step's byte count) is not state.
_OLD_KINDS = {"residual_slots": "residual", "velocity_slots": "dgc_velocity",
              "qs": "powersgd_q", "ranks": "auto_rank", "norm_sum": "auto_norm_sum",
              "norm_prev": "auto_norm_prev", "error_sum": "auto_error_sum",
              "error_last": "auto_error_last", "beyond_sum": "auto_beyond_sum",
              "beyond_last": "auto_beyond_last", "window_rank": "auto_window_rank",
              "raised": "auto_raised", "bytes_total": "auto_bytes_total", "step": "step"}
_OLD_KEY = re.compile(r"^(aggregator(?:_\d+)?|zero_residual(?:_\d+)?)/(\w+)(?:/(\w+))?/"
                      r"\.ATTRIBUTES/(?:per_replica|VARIABLE_VALUE)$")
# Any key of those objects (ZeRO's flat residual too: `zero_residual/.ATTRIBUTES/...`).
_OLD_OWNER = re.compile(r"^(aggregator|zero_residual)(_\d+)?/")


def _old_aggregator_names(reader, model, unmapped=None):
    """`{state name: checkpoint key}` of an older checkpoint's aggregator objects, named by
    the weights of the running model (its aggregator's positions, or without one its
    trainable weights in order; a pipeline's stage aggregators only onto the same; ZeRO
    1/2's aggregator, `zero_residual`, as `aggregator`). The keys of those objects that
    name nothing here are appended to `unmapped` (a list), if given."""
    keys = [k for k in reader.get_variable_to_shape_map() if _OLD_OWNER.match(k)]
    matches = [(m, k) for k in keys if (m := _OLD_KEY.match(k)) is not None]
    if unmapped is not None:
        unmapped.extend(k for k in keys if _OLD_KEY.match(k) is None)
    if not matches:
        return {}
    running = _aggregators(model)
    out = {}
    for match, checkpoint_key in matches:
        owner, attribute, position = match.groups()
        owner = owner.replace("zero_residual", "aggregator")
        aggregator = running.get(owner)
        if aggregator is not None and aggregator.positions:
            paths = _positions(aggregator, model)
            step_kind = aggregator.step_kind
        elif owner == "aggregator":
            paths = dict(enumerate(_path(w) for w in model.trainable_weights))
            auto = any(m.group(2) == "ranks" for m, _ in matches)
            step_kind = "auto_step" if auto else "step"
        else:
            paths, step_kind = {}, "step"
        if attribute == "moment_slots":
            kind, _, position = position.partition("_")
            kind = f"adam_{kind}"
        else:
            kind = _OLD_KINDS.get(attribute)
        if kind == "step":
            kind = step_kind
        index = int(position) if position is not None else 0
        if kind is None or index not in paths:
            if unmapped is not None and attribute != "wire_bytes":  # not state
                unmapped.append(checkpoint_key)
            continue
        out[f"codec/{paths[index]}/{kind}"] = checkpoint_key
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
    for meta in (LAYOUT, UNITS, ADAM_UNITS, ACCUMULATION):
        names.pop(meta, None)
    return {name: reader.get_tensor(k) for name, k in sorted(names.items())}


def _front_paths(names):
    """The weight paths with both Adam-in-front moments among state `names`."""
    paths = {_owner(n) for n in names if _kind(n) == "adam_m" and _owner(n)}
    return {p for p in paths if f"codec/{p}/adam_v" in names}


def _fronts(model):
    """Per Adam in front of a codec in `model`'s run (tf.distribute's aggregators, a mesh's
    `AdamFrontReduction`s), `units(steps=None)`: what its moments hold after `steps`
    steps, by default its own count (`adam_front.moment_units`); `units.steps`: whether
    it takes the steps (on one replica tf.distribute's leaves them to Keras's Adam)."""
    from tfpar.compression import adam_front
    from tfpar.compression import aggregator as aggregator_lib
    from tfpar.layout import values

    def units_of(variance, warm, refresh, adam, count, replicas):
        def units(steps=None):
            steps = int(count()) if steps is None else int(steps)
            return adam_front.moment_units(variance, warm, refresh, steps, adam)
        units.steps = replicas > 1
        return units
    out = []
    for a in _aggregators(model).values():
        if getattr(a, "adam", None) is not None and a.positions:
            count = (lambda a=a: aggregator_lib.local_values(a.step)[0].numpy())
            out.append(units_of(a.adam_variance, a.adam_warmup_steps, a.adam_refresh_every,
                                a.adam, count, _replicas_of(a)))
    for r in getattr(model, "tfpar_reductions", ()):
        if hasattr(r, "warm") and hasattr(r, "variance"):  # `tfpar.layout.adam_front`
            out.append(units_of(r.variance, r.warm, 0, (r.beta_1, r.beta_2, r.eps),
                                lambda r=r: values.to_host(r.count), r.replicas))
    return out


def _replicas_of(aggregator):
    """The replicas a built tf.distribute `aggregator` sums over (its step counter's strategy's;
    1 outside a strategy, or on `OneDeviceStrategy`, whose variables are plain)."""
    step = aggregator.step
    strategy = getattr(step, "distribute_strategy", None)
    if strategy is None or not hasattr(step, "values"):
        return 1
    return strategy.num_replicas_in_sync


def _drop_moved_residuals(entries, paths, name):
    """Zeroes the loaded error-feedback residuals of `paths`, whose Adam moments moved
    between Adam in front of a codec and Keras's Adam: in front a residual is in Adam
    steps' units (m/(sqrt(v)+eps)), behind in the gradient's, ~100x apart; not converted."""
    dropped = []
    for p in paths:
        n = f"codec/{p}/residual"
        value = np.asarray(entries[n][0]()) if n in entries else None
        if value is not None and value.any():
            entries[n][1](np.zeros_like(value))
            dropped.append(n)
    if dropped:
        logging.warning("tfpar: checkpoint %s: error feedback's residuals of %d weights whose "
                        "Adam moved between Adam in front of the codec and Keras's Adam are "
                        "in the other's units (Adam steps, gradients): not loaded, zero",
                        name, len(dropped))


def _owe_on_one_replica(model, path):
    """Sets the `debt_owed` flag of each tf.distribute aggregator on one replica (its
    own, or ZeRO 1/2's) to whether it loaded a debt (error feedback's residuals, not all
    zero): on one replica nothing is compressed, so no step would send it; the next applied
    step pays it, once (`keras_hook.pay_debt`). Cleared where the load brought none."""
    from tfpar.compression import aggregator as aggregator_lib
    for a in _aggregators(model).values():
        flag = getattr(a, "debt_owed", None)
        if not (a.positions and flag is not None):
            continue
        owes = any(np.any(aggregator_lib.local_values(r)[0].numpy())
                   for r in a.residuals.values())
        if owes and getattr(a, "adam", None) is not None:
            # Its rows are Adam steps there; on one replica Keras's Adam takes gradients.
            logging.warning("tfpar: checkpoint %s holds error feedback's debt of Adam in front "
                            "of its codec, which one replica (Keras's Adam) does not take: "
                            "not paid", os.path.basename(path))
            owes = False
        for local in aggregator_lib.local_values(flag):
            local.assign(owes)
        if owes:
            logging.warning("tfpar: checkpoint %s: error feedback's debt (the saved rows' sum) "
                            "is paid on this replica's next applied step",
                            os.path.basename(path))


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
    return _Read(tf_variable), write, tuple(tf_variable.shape)


class _Read:
    """A variable's full value as numpy (`read()`), the read of `_plain`'s entries.

    `variable`: the variable itself where a checkpoint may read it as a tensor
    (`LayoutState._serialize_to_tensors`, in one function a thread may trace), one whose
    read runs no collective; None for a DVariable (gathered whole through
    `values.to_host`, on the mesh) and a tf.distribute variable synchronised on read (its
    read may reduce over the workers), read in the step as numpy."""

    def __init__(self, variable):
        from tensorflow.experimental import dtensor
        self._variable = variable
        self.variable = (
            None if isinstance(variable, dtensor.DVariable)
            or variable.synchronization == tf.VariableSynchronization.ON_READ else variable)

    def __call__(self):
        from tfpar.layout import values
        return values.to_host(self._variable)


def _then(entry, after):
    """`entry` (read, write, shape) whose write calls `after()` once it has written (a
    mesh codec told its state was loaded: `AdamFrontReduction.state_written`)."""
    read, write, shape = entry

    def write_then(array):
        write(array)
        after()
    return read, write_then, shape


def _fits(shape, want):
    """A saved shape fits `want`, whose None dimensions take any size."""
    return len(shape) == len(want) and all(w is None or int(d) == w
                                           for d, w in zip(shape, want))


def _per_replica(variable):
    """(read, write, shape) of a mesh codec's residual `[replicas, ...]`: rows saved as they
    are; written onto another replica count, replica 0 takes what the saved rows owe and
    the others zero. A mesh's row is its replica's error in its own gradient's units and
    the step applies their mean: replica 0 takes the rows' sum × replicas here / replicas
    there (the sum alone would owe 2/4 of the error going from 2 replicas to 4)."""
    read, write, shape = _plain(variable)

    def write_rows(array):
        array = np.asarray(array)
        if array.shape[0] != shape[0]:
            rows = np.zeros(shape, array.dtype)
            rows[0] = array.sum(0) * (shape[0] / array.shape[0])
            array = rows
        write(array)
    return read, write_rows, (None,) + tuple(shape[1:])


def _mean_rows(variable, replicas, rows):
    """(read, write, shape) of Adam's moments in front of a mesh codec
    (`tfpar.layout.adam_front`), one row per replica as tf.distribute saves them: a
    variable of `rows` as it is, else its one value repeated; written onto another replica
    count, or into one value, every replica takes the rows' mean."""
    read, write, shape = _plain(variable)
    whole = tuple(shape[1:]) if rows else tuple(shape)

    def read_rows():
        value = read()
        return value if rows else np.repeat(value[None], replicas, 0)

    def write_rows(array):
        array = np.asarray(array)
        mean = array.mean(0, dtype=np.float64).astype(array.dtype)
        if not rows:
            write(array[0] if (array == array[:1]).all() else mean)
        elif array.shape[0] != replicas:
            write(np.repeat(mean[None], replicas, 0))
        else:
            write(array)
    return read_rows, write_rows, (None,) + whole


def _convert_rows(rows, written, wanted):
    """Residual `rows` (`[replicas, ...]`) written in units `written` (`UNITS`) in units
    `wanted`, for the same replica count (the write moves them onto another): a share is
    the replica's own error / replicas."""
    if written == wanted:
        return rows
    replicas = rows.shape[0]
    return rows / replicas if wanted == "share" else rows * replicas


def _replica_rows(variable, average):
    """(read, write, shape) of a tf.distribute aggregator's per-replica variable: every
    replica's value as a row (gathered from every worker); onto another replica count
    `PerReplicaSlot`'s rule (replica 0 the sum, or with `average` every replica the mean)."""
    from tfpar.compression import aggregator

    def write(array):
        aggregator.restore_replicas(variable, tf.constant(array), average)
    shape = tuple(aggregator.local_values(variable)[0].shape)
    return (lambda: aggregator.stack_replicas(variable).numpy()), write, (None,) + shape


def _same_on_replicas(variable):
    """(read, write, shape) of a tf.distribute aggregator's variable that every replica
    holds alike: read from this process's first replica, written to each."""
    from tfpar.compression import aggregator
    local = aggregator.local_values(variable)

    def write(array):
        for v in local:
            v.assign(np.asarray(array, v.dtype.as_numpy_dtype))
    return (lambda: local[0].read_value().numpy()), write, tuple(local[0].shape)


def _kind(name):
    """The kind of a codec state name (`codec/dense_0/kernel/residual`: `residual`)."""
    return name.rsplit("/", 1)[-1]


def _owner(name):
    """The weight path a codec state name belongs to (`codec/dense_0/kernel/residual`:
    `dense_0/kernel`), or None for another name."""
    return name[len("codec/"):].rsplit("/", 1)[0] if name.startswith("codec/") else None


def _count_kinds(names):
    """`residual (3), step (1)`: the kinds of state names, each with its count."""
    counts = {}
    for n in names:
        counts[_kind(n)] = counts.get(_kind(n), 0) + 1
    return ", ".join(f"{k} ({v})" for k, v in sorted(counts.items()))


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
