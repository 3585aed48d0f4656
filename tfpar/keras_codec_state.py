"""A `tfpar.DistributedOptimizer` codec's state in Keras's own files.

On a `keras.distribution` mesh (one mesh, `tfpar.layout.keras_step`, or the pipeline
mesh, `tfpar.layout.keras_pipeline`) the codec's state — each replica's error-feedback
residual, PowerSGD's Q, Adam in front's moments and step count, `auto`'s ranks — lives in
the batch-axis reductions (`tfpar.layout.reduction`), not among the Keras optimizer's
`variables`. `CodecState` puts it in the files Keras writes of the model (`model.save`,
`save_weights`, `ModelCheckpoint`, `BackupAndRestore`) and reads it back from them
(`load_weights`, `BackupAndRestore`'s restore):

Keras saves every `KerasSaveable` attribute of the optimizer it saves under that
attribute's name, so a `DistributedOptimizer` carries one `CodecState` as
`tfpar_codec_state` (set without TensorFlow's tracking: `tf.train.Checkpoint`s of the
optimizer are unchanged). Its entries are `codec/<weight path>/<kind>` as in tfpar's own
checkpoints (`tfpar.state`), each a whole host array (residuals one row per `batch`
replica), in the group `optimizer/tfpar_codec_state` of the file. Keras's own optimizer
entries are untouched, so stock Keras, which never looks into that group, loads the
file's optimizer state as before.

The file's config names such an optimizer, once it has run on a mesh, as tfpar's
`tfpar>Distributed<Base>` with its codec (`"compression"`: the aggregator's class and
config, and `"on_nan"`; `name_the_codec`), so `keras.saving.load_model` in a process that
imported tfpar gives a `DistributedOptimizer` with the same codec, whose `CodecState`
Keras's load then fills: under the same distribution `fit` goes on with the run. Stock
Keras, without tfpar, refuses such a file in one line (it cannot locate the class);
`load_weights` of it into a plain model still works.

Under `mixed_float16` the file names the `LossScaleOptimizer` around such an optimizer
`tfpar>CodecLossScaleOptimizer`, whose entries are the plain optimizers' as Keras's own
class writes them on the mesh, so `load_model` reads the loss scale back (Keras's class,
whose inner `DistributedOptimizer` has a counter of skipped steps, skipped them all).
Off a mesh (tf.distribute) the file names Keras's own `LossScaleOptimizer` around the plain
optimizer, for stock Keras: there Keras's class around a `DistributedOptimizer` writes its
entries without the inner optimizer's counter (`write_plain`: 14 entries over Adam and
four weights where it wrote 15, which stock Keras's `load_model` skipped, restarting the loss
scale) and reads such a file or one with the counter (`read_either`), through the registry
entry `loss_scale_files` of `tfpar.patches` (set by `tfpar.DistributedOptimizer`).

The group also records the codec that wrote it (`identity`: the mesh codec's name and the
options that give its state its meaning, as `tfpar.layout.reduction.codec_of` maps the
aggregator: top-k's ratio, union and dense size, threshold's magnitude, PowerSGD's rank,
lowbit's bits, error feedback, Adam in front, its rule for `v` and top-k's momentum
carry), as one entry `identity` beside the `codec/...` ones (a JSON text as bytes). A file
of another codec whose entries happen to have this codec's names and shapes (every lossy
codec keeps a residual per weight: top-k's read into threshold, another top-k ratio) is
refused in one line naming both. PowerSGD's `seed` (its first `Q` only) is not part of
it: a run may go on with another. Adam in front's `adam_warmup_steps` is: its moments are
kept in gradient units during the warm-up and in scaled units after it, so a file read
with another warm-up could be read in the wrong units (a review's probe: 1061 off in one
step). Only the options both sides record are compared (an option a later tfpar records
does not refuse older files). Off the mesh (no entries) no identity is written or asked:
a codec the mesh does not run still saves.

A file without that group (saved before it existed, or by a plain optimizer) loads as it
did: the codec's state stays as it is (fresh in a new model: the codec starts afresh),
and one line says so; a group without `identity` (written before it was recorded) is
checked by its entries alone, as then. Entries that do not match this
codec's (another codec, other weights or another `batch` size) are refused in one line.
Values read before the reductions exist (a `load_weights` before the first `fit`) are
held and written when they are made (`attach`).
"""

import json

import keras
import numpy as np
from absl import logging

from tfpar.errors import TfparError

ATTRIBUTE = "tfpar_codec_state"
_PREFIX = "codec/"
IDENTITY = "identity"  # the entry naming the codec (module docstring)
# `codec_of`'s options that do not change what the state means (module docstring)
_NOT_IDENTITY = ("seed",)


def _key(name):
    # an HDF5 dataset name cannot hold "/" (it would open groups)
    return name.replace("/", "|")


class CodecState(keras.layers.Layer):
    """The holder of a `DistributedOptimizer`'s codec state in Keras's files (module
    docstring). Not a layer of any model: a `keras.layers.Layer` is the public
    `KerasSaveable` whose `save_own_variables`/`load_own_variables` Keras calls."""

    def __init__(self, spec=None, aggregator=None, **kwargs):
        super().__init__(name=ATTRIBUTE, **kwargs)
        # what `name_the_codec` writes into the optimizer's config
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "aggregator", aggregator)  # its `identity`
        # [(reduction, {stage weight path: the model's weight path})], set by `attach`;
        # values loaded before it, by name
        object.__setattr__(self, "_reductions", [])
        object.__setattr__(self, "_pending", None)
        # set by `attach`: the optimizer runs on a mesh (its file names tfpar's classes)
        object.__setattr__(self, "on_mesh", False)

    def entries(self):
        """`{"codec/<path>/<kind>": DVariable}` of the attached reductions, under the
        model's weight paths, a repeated path (two nested models' Dense "proj") told apart
        in the model's order (`tfpar.layout.reduction.distinct_paths`)."""
        out = {}
        for reduction, paths in self._reductions:
            for name, (variable, _) in reduction.named_state().items():
                path, kind = name.rsplit("/", 1)
                key = f"{_PREFIX}{paths.get(path, path)}/{kind}"
                if key in out:  # a weight named twice would lose one's state in the file
                    raise TfparError(f"two codec state entries named {key}")
                out[key] = variable
        return out

    def identity(self):
        """The codec that writes this state, as a dict (module docstring), or None
        without an aggregator."""
        if self.aggregator is None:
            return None
        from tfpar.errors import ConfigError
        from tfpar.layout import reduction
        try:
            codec, error_feedback, options = reduction.codec_of(self.aggregator)
        except ConfigError:  # a codec the mesh does not run: no mesh state to name
            return None
        identity = {"codec": codec, "error_feedback": bool(error_feedback),
                    "adam_front": False,  # recorded when off too (only shared keys compare)
                    **{k: v for k, v in options.items() if k not in _NOT_IDENTITY}}
        return decode_identity(encode_identity(identity))  # as a file gives it back

    def save_own_variables(self, store):
        from tfpar.layout import values
        entries = self.entries()
        for name, variable in sorted(entries.items()):
            store[_key(name)] = values.to_host(variable)
        # only a mesh's state has entries (off the mesh, the identity is never asked:
        # a codec the mesh refuses must still save)
        identity = self.identity() if entries else None
        if identity is not None:
            store[IDENTITY] = encode_identity(identity)

    def load_own_variables(self, store):
        loaded = {key.replace("|", "/"): np.asarray(store[key]) for key in store.keys()}
        object.__setattr__(self, "_pending", loaded)
        if self._reductions:
            self._write()

    def attach(self, model, reductions, paths=None):
        """`attach`'s work on this holder (see there)."""
        from tfpar.layout import values
        # A trainer made again for the same optimizer (the first batch built the compiled
        # metrics: a key of the trainer changed) goes on with the state of the one before.
        before = {name: values.to_host(v) for name, v in self.entries().items()}
        paths = paths or [{}] * len(reductions)
        object.__setattr__(self, "_reductions", list(zip(reductions, paths)))
        object.__setattr__(self, "on_mesh", True)
        # Named even without a reduction (a mesh with one replica on `batch`, ZeRO-3's
        # "none"): the mesh optimizer's file holds its `nonfinite_steps`, which a plain
        # optimizer built by `load_model` lacks (Keras then skipped all its state).
        name_the_codec(model)
        if self._pending is not None:
            self._write()
            return
        now = self.entries()
        if before and sorted(before) == sorted(now) and all(
                before[n].shape == tuple(now[n].shape) for n in now):
            object.__setattr__(self, "_pending", before)
            self._write()

    def _write(self):
        """Writes the held values into the attached reductions (module docstring)."""
        from tfpar.layout import values
        loaded, entries = self._pending, self.entries()
        if not entries:
            object.__setattr__(self, "_pending", None)
            return
        if not loaded:
            object.__setattr__(self, "_pending", None)
            logging.warning("the file holds no codec state (saved before Keras's files "
                            "held it, or without a codec): the codec's state stays as it "
                            "is (in a new model: the codec starts afresh)")
            return
        loaded = dict(loaded)
        if IDENTITY in loaded:  # written since the identity was recorded
            check_identity(decode_identity(loaded.pop(IDENTITY)), self.identity())
        if sorted(loaded) != sorted(entries) or any(
                loaded[n].shape != tuple(entries[n].shape) for n in entries):
            theirs = ", ".join(f"{n} {loaded[n].shape}" for n in sorted(loaded)[:2])
            mine = ", ".join(f"{n} {tuple(entries[n].shape)}" for n in sorted(entries)[:2])
            raise TfparError(
                f"the file's codec state ({len(loaded)} entries: {theirs}, ...) does not fit "
                f"this optimizer's codec ({len(entries)} entries: {mine}, ...); load it with "
                "the codec, model and batch axis that saved it, or compile a new optimizer "
                "to start the codec afresh")
        # Held until it fits: a refused file stays refused at the next build (a second
        # `fit` after the error started the codec afresh without a word).
        object.__setattr__(self, "_pending", None)
        for name, variable in entries.items():
            values.assign(variable, loaded[name])
        for reduction, _ in self._reductions:
            written = getattr(reduction, "state_written", None)
            if written is not None:  # Adam in front: its warm-up copies are stale now
                written()


def encode_identity(identity):
    """`identity` (a dict) as the file's entry: its JSON text's bytes (an array any of
    Keras's stores holds)."""
    text = json.dumps(identity, sort_keys=True, default=lambda v: np.asarray(v).tolist())
    return np.frombuffer(text.encode(), np.uint8)


def decode_identity(entry):
    """The dict `encode_identity` wrote."""
    return json.loads(np.asarray(entry, np.uint8).tobytes().decode())


# The mesh's option names an identity records, as `tfpar.DistributedOptimizer` takes them.
_API_NAMES = {"powersgd_rank": "rank", "topk_ratio": "ratio", "topk_union": "union",
              "topk_dense_below": "dense_below", "lowbit_bits": "bits",
              "topk_momentum_carry": "adam_momentum_carry"}


def api_name(key):
    """An identity's key as `DistributedOptimizer`'s argument (`topk_ratio` -> `ratio`)."""
    return _API_NAMES.get(key, key)


def describe(identity):
    """`compression='topk' (ratio=0.1, ...)`: an identity in `DistributedOptimizer`'s
    words."""
    rest = ", ".join(sorted(f"{api_name(k)}={v!r}" for k, v in identity.items()
                            if k != "codec"))
    return f"compression={identity.get('codec')!r} ({rest})"


def check_identity(theirs, mine):
    """Raises `TfparError` (one line) when the file's codec (`theirs`) is not this
    optimizer's (`mine`); an optimizer without an identity takes any."""
    if mine is None:
        return
    # only what both record: an option a later tfpar adds does not refuse older files
    differ = sorted(api_name(k) for k in set(theirs) & set(mine) if theirs[k] != mine[k])
    if not differ:
        return
    raise TfparError(
        f"the file's codec state was written by {describe(theirs)}, this optimizer's "
        f"codec is {describe(mine)} (they differ in {', '.join(differ)}): its entries "
        "would mean another thing here; load it with the codec that saved it, or compile "
        "a new optimizer to start the codec afresh")


@keras.saving.register_keras_serializable(package="tfpar")
class CodecLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras's `LossScaleOptimizer` around a `DistributedOptimizer`, as Keras's files of a
    model whose codec ran on a mesh name it (`name_the_codec`): it writes what Keras's
    class writes, and reads a file with or without the inner optimizer's `nonfinite_steps`
    (the inner optimizer's last variable, after Keras's own).

    Keras's `LossScaleOptimizer` writes and reads its own variables and its inner
    optimizer's as one list. On one mesh the inner optimizer is the plain Keras class (no
    counter: the loss scale skips non-finite steps), so the file holds 6 entries over SGD;
    on the 3D mesh the compiled inner `DistributedOptimizer` keeps its counter (7).
    `load_model` builds the inner `DistributedOptimizer` before it loads, with its
    counter, so Keras's own class counted 7 against 6, skipped them all ("Skipping
    variable loading for optimizer ...") and the loaded run restarted its loss scale.
    Writing fewer than the live object holds instead made a 3D file that a fresh 3D
    model (7) skipped. Its load is `read_either`, which a `LossScaleOptimizer` around a
    `DistributedOptimizer` off a mesh also takes (`write_plain`)."""

    def load_own_variables(self, store):
        if not read_either(self, store):
            super().load_own_variables(store)  # as Keras (its line for a mismatch)


def _plain(optimizer):
    """A `LossScaleOptimizer`'s variables (its own, then its inner optimizer's) without the
    inner optimizer's `nonfinite_steps` (tfpar's counter, `tfpar.nan_guard`), and that
    counter (None without one)."""
    counter = getattr(optimizer.inner_optimizer, "nonfinite_steps", None)
    return [v for v in optimizer.variables if v is not counter], counter


def _own(optimizer):
    """A `LossScaleOptimizer`'s own variables (the loss scale's, not its inner
    optimizer's)."""
    inner = {id(v) for v in optimizer.inner_optimizer.variables}
    return [v for v in optimizer.variables if id(v) not in inner]


class _Shapes(dict):
    """A store that keeps each entry's shape only (an offloaded optimizer's host slots are
    not held twice)."""

    def __setitem__(self, key, value):
        super().__setitem__(key, tuple(np.shape(value)))


def _inner_shapes(optimizer):
    """The shapes of the entries the inner optimizer writes to a file of its own
    (`save_own_variables`: without tfpar's counter; an offloaded optimizer's host slots,
    `tfpar.offload`), in order."""
    shapes = _Shapes()
    optimizer.inner_optimizer.save_own_variables(shapes)
    return [shapes[str(i)] for i in range(len(shapes))]


class _Shifted:
    """`store`'s entries from `start` on, as a store of their own (`"0"`, `"1"`, ...):
    read, and written."""

    def __init__(self, store, start):
        self.store, self.start = store, start

    def __setitem__(self, key, value):
        self.store[str(int(key) + self.start)] = value

    def keys(self):
        return [str(i) for i in range(len(self.store.keys()) - self.start)]

    def __getitem__(self, key):
        return self.store[str(int(key) + self.start)]


def read_either(optimizer, store):
    """Reads a file's entries of a `LossScaleOptimizer` (`store`) into `optimizer` when
    they are its variables without the inner optimizer's counter (what Keras's class
    around the plain optimizer writes), or, for an optimizer without one, those followed
    by one number (a writer's counter, last); returns whether it read them. Anything else
    (also every entry, counter and all, or a shape that differs) is left to Keras's own
    load, which reads a file of as many entries as the optimizer holds and skips any
    other with its warning."""
    plain, counter = _plain(optimizer)
    stored = len(store.keys())
    if counter is not None and stored != len(optimizer.variables):
        # `write_plain`'s form: the loss scale's own variables, then the inner optimizer's
        # own file entries (host slots too, when offloaded), read by the inner optimizer
        own, inner = _own(optimizer), _inner_shapes(optimizer)
        if stored == len(own) + len(inner) and all(
                tuple(np.shape(store[str(i)])) == tuple(shape)
                for i, shape in enumerate([v.shape for v in own] + inner)):
            for i, variable in enumerate(own):
                variable.assign(store[str(i)])
            optimizer.inner_optimizer.load_own_variables(_Shifted(store, len(own)))
            return True
    extra = counter is None and stored == len(plain) + 1 and np.shape(
        store[str(len(plain))]) == ()  # a writer's counter: one number, last
    if stored == len(optimizer.variables) or (stored != len(plain) and not extra) or any(
            tuple(np.shape(store[str(i)])) != tuple(v.shape) for i, v in enumerate(plain)):
        return False
    for i, variable in enumerate(plain):
        variable.assign(store[str(i)])
    return True


def write_plain(optimizer, store):
    """Writes a `LossScaleOptimizer` around a `DistributedOptimizer` off a mesh as Keras's
    class around the plain optimizer writes it (the inner optimizer's counter left out,
    as the inner optimizer's own entries leave it out), so stock Keras's `load_model` of
    the file reads the loss scale; returns whether it wrote them. On a mesh (the codec's
    state attached, the file naming `CodecLossScaleOptimizer`) and around an optimizer
    without a counter, Keras's own save writes every variable."""
    _, counter = _plain(optimizer)
    holder = holder_of(optimizer)
    if counter is None or (holder is not None and holder.on_mesh):
        return False
    # the loss scale's own variables, then what the inner optimizer writes to its own
    # entries (its counter left out; an offloaded optimizer's host slots in)
    own = _own(optimizer)
    for i, variable in enumerate(own):
        store[str(i)] = variable.numpy()
    optimizer.inner_optimizer.save_own_variables(_Shifted(store, len(own)))
    return True


_LOSS_SCALE = ("LossScaleOptimizer", CodecLossScaleOptimizer.__name__)


def add_to(optimizer, aggregator, on_nan):
    """Gives `optimizer` (a `DistributedOptimizer` of `aggregator`, `on_nan`) its
    `CodecState`; returns it."""
    holder = CodecState({"compression": {"class_name": type(aggregator).__name__,
                                         "config": aggregator.get_config()},
                         "on_nan": on_nan}, aggregator)
    object.__setattr__(optimizer, ATTRIBUTE, holder)
    return holder


def holder_of(optimizer):
    """The `CodecState` of `optimizer` or of its inner optimizer (a `LossScaleOptimizer`
    around a `DistributedOptimizer`), or None."""
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        holder = getattr(candidate, ATTRIBUTE, None) if candidate is not None else None
        if holder is not None:
            return holder
    return None


def attach(model, optimizer, reductions, paths=None):
    """Makes `optimizer`'s `CodecState` (if it has one) save and load `reductions` (the
    mesh's, replacing any attached before) and `model`'s files name the codec
    (`name_the_codec`); `paths`: per reduction, `{its weight path: the path of the
    model's weight}` (a pipeline stage's copies). Values a file gave it before are written
    now; else a trainer made again for the same optimizer goes on with the state of the
    reductions attached before (same entries and shapes)."""
    holder = holder_of(optimizer)
    if holder is not None:
        holder.attach(model, reductions, paths)


def name_the_codec(model):
    """Makes Keras's files of `model` name its `DistributedOptimizer` as tfpar's
    `tfpar>Distributed<Base>` with the codec in its config (module docstring), and a
    `LossScaleOptimizer` around it as `tfpar>CodecLossScaleOptimizer`: the model's own
    `get_compile_config` (which Keras's saving calls) with the optimizer's entry renamed.
    Optimizers whose base class tfpar does not register stay as they are (their file
    loads the plain optimizer)."""
    if "get_compile_config" in vars(model):
        return

    def get_compile_config():
        config = type(model).get_compile_config(model)
        entry = outer = (config or {}).get("optimizer")
        if isinstance(entry, dict) and entry.get("class_name") in _LOSS_SCALE:
            entry = entry.get("config", {}).get("inner_optimizer")
        else:
            outer = None
        holder = holder_of(model.optimizer)
        if not isinstance(entry, dict) or holder is None or holder.spec is None:
            return config
        from tfpar import api
        name = entry.get("class_name")
        if name not in api.REGISTERED_BASES:
            return config
        entry.update(class_name=f"Distributed{name}", module=None,
                     registered_name=f"tfpar>Distributed{name}")
        entry["config"] = {**entry["config"], **holder.spec}
        if outer is not None:  # the loss scale's entries read as written
            name = CodecLossScaleOptimizer.__name__
            outer.update(class_name=name, module=None, registered_name=f"tfpar>{name}")
        return config

    object.__setattr__(model, "get_compile_config", get_compile_config)
