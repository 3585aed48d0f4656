"""Checkpoints of the whole training state, and resume at the saved step.

What is saved: model weights, optimizer state (slots, iterations, loss scale), a gradient
codec's state (residuals, PowerSGD's Qs, ...) and the data position (steps done; the data
is a function of the step, see `tfpar.data`), under the names of the single-device model
(`tfpar.state`), so any other layout and backend loads it.

A save is published in three moves (`tfpar.checkpoint_writer`): the checkpoint's files
(`ckpt-S.index`, `ckpt-S.data-*`), its manifest (each file's size and CRC32), then the
`checkpoint` state file of `tf.train.CheckpointManager`, replaced atomically (a rename) so
that it names `ckpt-S` as the latest. A run killed before the rename leaves files that
nothing names: restore reads only what the state file names, so it takes the previous
complete checkpoint, and the chief deletes the unnamed leftovers when it restores.
(tests/test_faults.py kills workers inside that window.) With `checkpoint_async` (the
default) the step blocks only while the state is read into host memory; a thread writes
and publishes it while training goes on, one write at a time; `wait()` (the last save, a
preemption save) returns once it is published. On a DTensor mesh the same: the state is
gathered whole to host memory in the step (`tfpar.state`), and the thread writes host
tensors only, running no op on the mesh's devices.

Restore takes the newest save the state file names whose files match their manifest and
read back; a damaged one (truncated, changed, missing) is skipped with one line saying
what is wrong with it. When none is intact the run stops with one line and deletes
nothing.

Multi-worker: every worker must take part in a save; the chief writes to `checkpoint_dir`,
the others to a scratch directory they delete afterwards. Every worker restores from the
chief's directory, so all resume at the same step (the directory must be shared, as it is
for workers on one machine or on a shared filesystem).

Another world size: a checkpoint written by N workers (or replicas) restores on M. The
saved state does not depend on the count: the model and optimizer are the same on every
replica, the global batch is a setting (`global_batch_size`, checked by the marker), so
each step consumes the same examples whatever the split (`tfpar.data`: example `i` of step
`s` is the same for any number of replicas), and a codec's per-replica residuals are
re-distributed with what they owe kept (`tfpar.state`: replica 0 takes it; said only when the run
keeps residuals: a codec with error feedback).
`world.json` records each change as `{"step", "workers", "replicas"}` (the metrics'
`elastic` list).

A `tfpar.json` marker records the settings the saved variables depend on. A directory that
holds files but no marker is someone else's and is refused, never overwritten; a marker
from an incompatible run is refused with what differs.
"""

import json
import os
import re
import shutil

import keras
import tensorflow as tf
from absl import logging

from tfpar import checkpoint_writer, faults, patches, state
from tfpar.errors import ConfigError

MARKER = "tfpar.json"
WORLD = "world.json"
# Settings that change which variables exist or what they mean.
_STATE_SETTINGS = ("model", "model_width", "model_depth", "dataset", "num_classes",
                   "optimizer", "grad_accum_steps", "mixed_precision", "compression",
                   "powersgd_rank", "error_feedback", "global_batch_size", "seed")
# Settings that mean something only with one compression: compared (and written) only then,
# so a default that changed for PowerSGD does not refuse every other run's checkpoint.
_ONLY_WITH = {"powersgd_rank": "powersgd"}


def _state_settings(settings):
    """The `_STATE_SETTINGS` of `settings` (a dict), `None` where they do not apply."""
    out = {k: settings.get(k) for k in _STATE_SETTINGS}
    for k, compression in _ONLY_WITH.items():
        if out["compression"] != compression:
            out[k] = None
    return out


# What a save writes: ckpt-S.index, ckpt-S.data-K-of-N, TensorFlow's ckpt-S_temp* while it
# writes them, and the manifest (and its .tmp while it is written).
_CHECKPOINT_FILE = re.compile(
    r"^(ckpt-\d+)(\.index|\.data-\d+-of-\d+|_temp.*|\.manifest\.json(\.tmp)?)$")


class Checkpointer(keras.callbacks.Callback):
    """Saves every `checkpoint_every` steps and at the end of training; restores on start.

    Args:
        config: the run's `ParallelConfig` (checkpoint_dir, checkpoint_every,
            keep_checkpoints, checkpoint_async).
        model: a compiled model whose optimizer is built.
        runtime: the `tfpar.strategy.Runtime` (chief or not, worker index).
        writer_nice: with `checkpoint_async`, the writer thread's nice value above
            training's (`checkpoint_writer.Writer`; `tools/bench_checkpoint.py --nice`
            measures it against 0).
    """

    def __init__(self, config, model, runtime, writer_nice=0):
        super().__init__()
        self.config = config
        # Absolute, as the prefixes the async writer publishes are: TensorFlow stores a
        # prefix relative to the directory only when both are absolute or both relative.
        self.directory = os.path.abspath(config.checkpoint_dir)
        self.every = config.checkpoint_every
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self._step = self._saved = 0
        # What is written: the state under layout-independent names (`tfpar.state`, every
        # codec's too, ZeRO 1/2's included), so any layout loads it; the step beside it.
        self._state = state.LayoutState(model, state.layout_of(config, runtime))
        self._others = {"step": self.step, **state.aggregators_of(model)}
        self._checkpoint = tf.train.Checkpoint(state=self._state, **self._others)
        check_directory(config)
        self._write_dir = (self.directory if runtime.is_chief
                           else os.path.join(self.directory, f".worker_{runtime.worker_index}"))
        self._is_chief = runtime.is_chief
        # The world size, when the runtime knows it (a user's own script's does not).
        self._world = ({"workers": runtime.workers, "replicas": runtime.replicas}
                       if hasattr(runtime, "workers") and hasattr(runtime, "replicas") else None)
        self.elastic = []  # world-size changes so far, as the metrics' `elastic` list
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, self._write_dir, max_to_keep=config.keep_checkpoints,
            checkpoint_name="ckpt")
        # A codec's state (a tf.distribute aggregator's, ZeRO 1/2's) is read into the
        # snapshot by `tfpar.state`, in the step. (Saved as its own `SyncOnRead` variables,
        # TensorFlow deferred their reads to the writer thread: the first async save held
        # PowerSGD's step counter and Qs of 10 steps later; tests/test_checkpoint_async.py
        # compares every tensor with the synchronous save's under load.)
        self._writer = (checkpoint_writer.Writer(nice=writer_nice)
                        if getattr(config, "checkpoint_async", False) else None)
        self._snapshot_cache = {}
        self.costs = checkpoint_writer.Costs()  # each save's phases, CPU and wall time

    def restore(self):
        """Restores the newest intact published checkpoint of the chief's directory;
        returns the step to resume at (0 if there is none). A damaged newer one is skipped
        with one line. The chief then deletes the files of saves that were cut short
        (never published).

        Raises:
            ConfigError: no published checkpoint is intact (nothing is deleted), or the
                intact one does not match this model and optimizer.
        """
        restored, damaged = None, []
        for prefix in published(self.directory):
            problem = checkpoint_writer.damage(prefix) or self._read(prefix)
            if problem is None:
                restored = prefix
                break
            name = os.path.basename(prefix)
            damaged.append(f"{name}: {problem}")
            logging.warning("tfpar: skipping checkpoint %s of %s: %s; trying the one before",
                            name, self.directory, problem)
        if damaged and restored is None:
            raise ConfigError("checkpoint_dir", self.directory,
                              f"holds no intact checkpoint ({'; '.join(damaged)}); nothing "
                              "was changed: restore the files from a copy, or move them "
                              "away to start afresh")
        if self._is_chief and os.path.isdir(self.directory):
            remove_unpublished(self.directory)
        if restored is None:
            return 0
        self._step = self._saved = int(self.step.numpy())
        self.elastic = self._note_world(self._step)
        return self._step

    def _read(self, prefix):
        """Restores checkpoint `prefix`; returns None, or what is wrong with its files when
        TensorFlow cannot read them.

        Raises:
            ConfigError: it reads, but does not match this model and optimizer.
        """
        try:
            state.load(prefix, self._state, self._others)
        except (AssertionError, ValueError, tf.errors.NotFoundError) as err:
            # it reads, but names or shapes differ (files missing are the manifest's)
            raise ConfigError("checkpoint_dir", self.directory,
                              f"its checkpoint {os.path.basename(prefix)} does not match this "
                              f"model and optimizer ({str(err).splitlines()[0]})") from None
        except (tf.errors.OpError, IndexError) as err:  # a truncated or garbled file
            return (f"TensorFlow cannot read it ({type(err).__name__}: "
                    f"{(str(err).splitlines() or [''])[0][:200]})")
        return None

    def _note_world(self, step):
        """Compares the world size with the one the checkpoint was written by; logs and (chief)
        records a change. Returns the changes so far (empty if there was none)."""
        if self._world is None:
            return []
        history = read_world(self.directory)
        last = history[-1] if history else None
        if last is not None and (last["workers"], last["replicas"]) != (
                self._world["workers"], self._world["replicas"]):
            logging.warning(
                "tfpar: world size changed at step %d: %d worker(s), %d replica(s) (the "
                "checkpoint was written by %d worker(s), %d replica(s)); global batch kept at "
                "%d (%s per replica)%s",
                step, self._world["workers"], self._world["replicas"], last["workers"],
                last["replicas"], self.config.global_batch_size,
                self.config.replica_split(self._world["replicas"], False).describe(),
                "; residuals re-distributed with what they owe kept"
                if self.config.compression != "none" and self.config.error_feedback else "")
            history.append({"step": step, **self._world})
            if self._is_chief:
                write_json_atomic(os.path.join(self.directory, WORLD), history)
        return [{"step": h["step"], "workers": h["workers"], "replicas": h["replicas"]}
                for h in history[1:]]

    @property
    def saved_step(self):
        """The step of the newest save (or restore)."""
        return self._saved

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._step % self.every == 0:
            self.save()

    def save(self):
        """Saves the state after the steps done so far (once per step, however often
        called)."""
        if self._step == self._saved:
            return
        if self._writer is not None:
            # A failed previous write raises here, before this step counts as saved (a
            # later save of the same step must not return at once).
            self._writer.wait()
        self._saved = self._step
        self.step.assign(self._step)
        if self._is_chief:
            # Before any checkpoint file: a first save cut short must leave a directory
            # that a restart recognises as its own, not one it refuses as foreign.
            write_marker(self.config)
            if self._world and not os.path.exists(os.path.join(self.directory, WORLD)):
                write_json_atomic(os.path.join(self.directory, WORLD),
                                  [{"step": 0, **self._world}])
        step = self._step
        prefix = os.path.join(self._write_dir, f"ckpt-{step}")  # absolute, as the directory
        timed = checkpoint_writer.Costs.timed
        if self._writer is None:
            cost = self.costs.new(step)
            faults.pause_in_save(step, "before_writing")
            # Write callbacks run after the files are written, before the state file
            # names them.
            options = tf.train.CheckpointOptions(experimental_write_callbacks=[
                lambda: self._before_publishing(step, prefix, cost)])
            timed(cost, "save", lambda: self._manager.save(checkpoint_number=step,
                                                           options=options))
            self._written()
            self.costs.done(cost)
            return
        self._writer.wait()  # one write in flight at most
        # After the wait: a failed previous write raises there, and this save never starts.
        cost = self.costs.new(step)
        self._checkpoint.save_counter.assign_add(1)  # as the manager's save does
        # The only blocking part.
        batched = self._snapshot_cache.get("batched", 0)
        values = timed(cost, "snapshot", patches.checkpoint_snapshot, self._checkpoint,
                       self._snapshot_cache, _mesh_to_host)
        # Whether the variables were read in one call (the first save reads them one by
        # one; a save whose objects changed would too, and trace the call again).
        cost["batched_reads"] = self._snapshot_cache.get("batched", 0) > batched

        def write():
            faults.pause_in_save(step, "before_writing")
            timed(cost, "write", patches.write_checkpoint, values, prefix)
            self._before_publishing(step, prefix, cost)
            timed(cost, "publish", patches.publish_checkpoint, self._manager, prefix)
            self._written()
            # the next save's reads
            timed(cost, "trace", patches.trace_checkpoint_reads, self._snapshot_cache)

        def write_and_account():
            timed(cost, "writer", write)
            self.costs.done(cost)  # complete: every phase, the writer's whole included
        self._writer.submit(step, write_and_account)

    def wait(self):
        """Returns once the newest save is published (at once for a synchronous save).

        Raises:
            TfparError: its write failed; the previous checkpoint is still the latest.
        """
        if self._writer is not None:
            self._writer.wait()

    def _before_publishing(self, step, prefix, cost):
        patches.wait_for_checkpoint_files()
        checkpoint_writer.Costs.timed(cost, "manifest", checkpoint_writer.write_manifest, prefix)
        # Off unless a test asks for it: a window to kill in, files written, none named.
        faults.pause_in_save(step)

    def _written(self):
        if not self._is_chief:
            shutil.rmtree(self._write_dir, ignore_errors=True)
            return
        # The manager deletes the files of saves past `keep_checkpoints`, not our manifests.
        kept = {os.path.basename(p) for p in self._manager.checkpoints}
        for name in os.listdir(self.directory):
            if (name.endswith(checkpoint_writer.MANIFEST)
                    and name[:-len(checkpoint_writer.MANIFEST)] not in kept):
                os.remove(os.path.join(self.directory, name))


def _mesh_to_host(value):
    """A DTensor's whole value as numpy (read in the step, not by the writer thread)."""
    from tfpar.layout import values
    return values.to_host(value)


def published(directory):
    """The checkpoint prefixes `directory`'s state file names, newest first (none if there
    is no state file).

    Raises:
        ConfigError: the state file is unreadable (nothing is deleted).
    """
    # TensorFlow gives the state file's relative names joined to `directory`: absolute
    # here, so they are the files' paths from any working directory.
    directory = os.path.abspath(directory)
    if not os.path.exists(os.path.join(directory, "checkpoint")):
        return []
    try:
        state = tf.train.get_checkpoint_state(directory)
    except Exception as err:  # noqa: BLE001 -- a text-format parse error, any kind
        raise ConfigError("checkpoint_dir", directory,
                          f"its state file 'checkpoint' is unreadable ({type(err).__name__}); "
                          "nothing was changed: restore it from a copy, or move the "
                          "directory away to start afresh") from None
    if state is None:
        return []
    paths = list(state.all_model_checkpoint_paths)
    latest = state.model_checkpoint_path
    return ([latest] if latest else []) + [p for p in reversed(paths) if p != latest]


def newest_intact(directory):
    """The newest published checkpoint of `directory` whose files match its manifest, or
    None (without reading it: `Checkpointer.restore` also skips one TensorFlow cannot
    read)."""
    return next((p for p in published(directory) if checkpoint_writer.damage(p) is None),
                None)


def remove_unpublished(directory):
    """Deletes checkpoint files of `directory` that its state file does not name: what a
    save killed before publishing left. Returns the names removed."""
    state = tf.train.get_checkpoint_state(directory)
    named = {os.path.basename(p) for p in (state.all_model_checkpoint_paths if state else [])}
    removed = []
    for name in sorted(os.listdir(directory)):
        match = _CHECKPOINT_FILE.match(name)
        if match and match.group(1) not in named:
            path = os.path.join(directory, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(name)
    if removed:
        logging.info("removed %s: a save cut short before it was published", removed)
    return removed


def check_directory(config):
    """Refuses a `checkpoint_dir` holding foreign files or an incompatible run's state."""
    directory = config.checkpoint_dir
    marker = os.path.join(directory, MARKER)
    if not os.path.isdir(directory):
        return
    if os.path.exists(marker):
        with open(marker) as f:
            saved = json.load(f)
        saved = _state_settings(saved)
        now = _state_settings({k: getattr(config, k) for k in _STATE_SETTINGS})
        differ = [f"{k}: saved {saved[k]!r}, now {now[k]!r}"
                  for k in _STATE_SETTINGS if saved[k] != now[k]]
        if differ:
            raise ConfigError("checkpoint_dir", directory,
                              "holds a checkpoint of an incompatible run (" + "; ".join(differ)
                              + "); use a new directory or the same settings")
        return
    foreign = [name for name in os.listdir(directory) if not name.startswith(".worker_")]
    if foreign:
        raise ConfigError("checkpoint_dir", directory,
                          f"holds files tfpar did not write ({', '.join(sorted(foreign)[:3])}"
                          f"{', …' if len(foreign) > 3 else ''}); choose an empty or new "
                          "directory so nothing of yours is overwritten")


def read_world(directory):
    """The world sizes a checkpoint directory was trained at: `[{"step", "workers",
    "replicas"}, ...]`, first the one that started it (empty if none was recorded)."""
    try:
        with open(os.path.join(directory, WORLD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def write_json_atomic(path, value):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def write_marker(config):
    path = os.path.join(config.checkpoint_dir, MARKER)
    if os.path.exists(path):
        return
    os.makedirs(config.checkpoint_dir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_state_settings({k: getattr(config, k) for k in _STATE_SETTINGS}), f,
                  indent=1)
    os.replace(tmp, path)


def fit_segments(start, total, per_epoch):
    """Splits batches `start … total-1` into `fit` calls of whole epochs.

    Returns a list of `(initial_epoch, epochs, steps_per_epoch, first_batch)`; a resumed
    run first finishes its partial epoch, and a last partial epoch gets a call of its own.

    >>> fit_segments(0, 10, 4)
    [(0, 2, 4, 0), (2, 3, 2, 8)]
    >>> fit_segments(5, 12, 4)
    [(1, 2, 3, 5), (2, 3, 4, 8)]
    """
    segments = []
    batch = start
    while batch < total:
        epoch = batch // per_epoch
        length = min(per_epoch - batch % per_epoch, total - batch)
        if (segments and length == per_epoch and segments[-1][2] == per_epoch
                and segments[-1][3] + (segments[-1][1] - segments[-1][0]) * per_epoch == batch):
            initial, epochs, steps, first = segments[-1]
            segments[-1] = (initial, epochs + 1, steps, first)
        else:
            segments.append((epoch, epoch + 1, length, batch))
        batch += length
    return segments
