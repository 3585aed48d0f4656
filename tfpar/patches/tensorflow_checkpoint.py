"""TensorFlow's checkpoint writer split in two, for a save that blocks only for the copy.

- `checkpoint_snapshot`: `snapshot(checkpoint)` runs what `tf.train.Checkpoint.write` does
  before it writes (`TrackableSaver._gather_serialized_tensors`: every object's
  `_serialize_to_tensors`, the object graph) and reads every value now, in the caller's
  thread, so that every worker's collectives inside a serialisation (tfpar's
  `PerReplicaSlot` gathers replicas) run in step; `write(snapshot, prefix)` writes those
  values later with the same `functional_saver.MultiDeviceSaver` (TensorFlow's format,
  the `_temp` directory renamed into place); `publish(manager, prefix)` then does what
  `CheckpointManager.save` does after its write (`_record_and_sweep_state`: the state file
  names the new save, old ones past `max_to_keep` are deleted). TensorFlow's own
  `CheckpointOptions(experimental_enable_async_checkpoint=True)` was not used: it copies
  only objects that implement `_copy_trackable_to_cpu` and serialises the others (tfpar's
  residuals and ZeRO slots) in its writer thread, after training moved on: it saved a
  value of a later step (docs/benchmarks/checkpoint.md). The checks compare the source
  fragments these functions repeat or call.
"""

import os
import time

import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint as _checkpoint
from tensorflow.python.checkpoint import checkpoint_management as _management
from tensorflow.python.checkpoint import functional_saver as _functional_saver
from tensorflow.python.training.saving import saveable_object as _saveable_object

from tfpar.patches.versions import check_entries

ENTRIES = {
    "checkpoint_snapshot": (
        "tensorflow.python.checkpoint: TrackableSaver._gather_serialized_tensors, "
        "functional_saver.MultiDeviceSaver, CheckpointManager.save's "
        "_record_and_sweep_state (_maybe_delete, _latest_checkpoint, _record_state, _sweep)",
        "tfpar.checkpoint_writer"),
}
FRAGMENTS = {
    "checkpoint_snapshot": [
        ("TrackableSaver._gather_serialized_tensors",
         lambda: ("signature", _checkpoint.TrackableSaver._gather_serialized_tensors),
         "(self, object_graph_tensor=None)"),
        ("TrackableSaver._gather_serialized_tensors",
         lambda: _checkpoint.TrackableSaver._gather_serialized_tensors,
         "return serialized_tensors, feed_additions, registered_savers, graph_proto"),
        ("TrackableSaver._save_cached_when_graph_building",
         lambda: _checkpoint.TrackableSaver._save_cached_when_graph_building,
         "saver = functional_saver.MultiDeviceSaver(serialized_tensors,\n"
         "                                                registered_savers)"),
        ("MultiDeviceSaver.save", lambda: ("signature", _functional_saver.MultiDeviceSaver.save),
         "(self, file_prefix: tensorflow.python.framework.tensor.Tensor, options: "
         "'checkpoint_options.CheckpointOptions | None' = None) -> "
         "tensorflow.python.framework.ops.Operation"),
        ("CheckpointManager.save", lambda: _management.CheckpointManager.save,
         "      self._maybe_delete[save_path] = timestamp\n"
         "      self._latest_checkpoint = save_path\n"),
        ("CheckpointManager.save", lambda: _management.CheckpointManager.save,
         "      self._record_state()\n      self._sweep()\n"),
        ("SaveSpec", lambda: ("signature", _saveable_object.SaveSpec.__init__),
         "(self, tensor, slice_spec, name, dtype=None, device=None)"),
    ],
}


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    return check_entries(names, "tensorflow", FRAGMENTS, ENTRIES)


def snapshot(checkpoint):
    """The values `checkpoint` (a `tf.train.Checkpoint`) would write now, read now.

    An eager tensor read from a variable keeps its value when the variable is updated
    later (TensorFlow copies a buffer before updating it in place while a reader holds
    it). Registry entry `checkpoint_snapshot`.

    Raises:
        NotImplementedError: an object saves through a registered saver (written by its
            own code at write time; not snapshotted).
    """
    checkpoint.save_counter  # noqa: B018 -- created before the object graph is read
    serialized, _, registered, _ = checkpoint._saver._gather_serialized_tensors(None)
    if registered:
        raise NotImplementedError(f"registered savers {sorted(registered)}")
    for tensors in serialized.values():
        for key, value in tensors.items():
            tensors[key] = ({spec: _read(v) for spec, v in value.items()}
                            if isinstance(value, dict) else _read(value))
    return serialized


def _read(value):
    """A SaveSpec whose tensor is read now (a variable's is a callable, read at write)."""
    if isinstance(value, _saveable_object.SaveSpec):
        return _saveable_object.SaveSpec(value.tensor, value.slice_spec, value.name,
                                         dtype=value.dtype, device=value.device)
    if isinstance(value, tf.Variable):  # would be read at write time
        return value.read_value()
    return value


def write(values, prefix):
    """Writes a `snapshot` as TensorFlow's checkpoint `prefix` (`prefix.index`,
    `prefix.data-*`). Registry entry `checkpoint_snapshot`."""
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    saver = _functional_saver.MultiDeviceSaver(values)
    with tf.device("/cpu:0"):
        path = tf.constant(prefix)
    saver.save(path)


def publish(manager, prefix):
    """Names `prefix` (written by `write`) in `manager`'s state file as its latest save and
    deletes saves past its `max_to_keep`, as `CheckpointManager.save` does after writing.
    Registry entry `checkpoint_snapshot`."""
    if prefix in manager._maybe_delete:
        del manager._maybe_delete[prefix]
    manager._maybe_delete[prefix] = time.time()
    manager._latest_checkpoint = prefix
    manager._record_state()
    manager._sweep()
    manager._record_state()
