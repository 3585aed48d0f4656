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
  value of a later step (docs/benchmarks/checkpoint.md). `deferred_read(variable)`: a
  variable as a trackable's saved value, read as TensorFlow defers its own variables' reads
  (tfpar's `LayoutState` saves its plain variables so: `snapshot` reads them with the
  others in one function, without copying). The checks compare the source fragments these
  functions repeat or call.
"""

import os
import time

import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor as _dtensor
from tensorflow.python.checkpoint import checkpoint as _checkpoint
from tensorflow.python.checkpoint import checkpoint_management as _management
from tensorflow.python.checkpoint import functional_saver as _functional_saver
from tensorflow.python.checkpoint import tensor_callable as _tensor_callable
from tensorflow.python.eager import context as _context
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops
from tensorflow.python.training.saving import saveable_object as _saveable_object

from tfpar.patches.versions import check_entries

ENTRIES = {
    "checkpoint_snapshot": (
        "tensorflow.python.checkpoint: TrackableSaver._gather_serialized_tensors, "
        "functional_saver.MultiDeviceSaver, CheckpointManager.save's "
        "_record_and_sweep_state (_maybe_delete, _latest_checkpoint, _record_state, _sweep)",
        "tfpar.checkpoint_writer, tfpar.state"),
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
        ("tensor_callable.Callable", lambda: _tensor_callable.Callable,
         "class Callable(saveable_object.SaveSpec)"),
        ("Checkpoint._write", lambda: _checkpoint.Checkpoint._write,
         "    if context.executing_eagerly():\n      context.async_wait()"),
        ("SaveSpec.tensor", lambda: _saveable_object.SaveSpec.tensor.fget,
         "return self._tensor() if callable(self._tensor) else self._tensor"),
        ("BaseResourceVariable._serialize_to_tensors",
         lambda: _resource_variable_ops.BaseResourceVariable._serialize_to_tensors,
         "tensor_callable.Callable(\n                _read_variable_closure"),
    ],
}


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    return check_entries(names, "tensorflow", FRAGMENTS, ENTRIES)


def snapshot(checkpoint, cache, to_host=None):
    """The values `checkpoint` (a `tf.train.Checkpoint`) would write now, read now.

    An eager tensor read from a variable keeps its value when the variable is updated
    later (TensorFlow copies a buffer before updating it in place while a reader holds
    it). The variables' reads (TensorFlow defers them to the write, one callable each) run
    in one `tf.function` kept in `cache` (a dict the caller keeps) while the objects and
    keys to save stay the same: one call instead of two eager ops per variable. A save
    whose objects are new reads eagerly; `trace_reads(cache)` (in the writer thread)
    readies the function for the next. A value that is a DTensor (on a mesh's devices) is
    replaced by `to_host(value)`, read here, so that `write` runs no op on a mesh's devices
    (a mesh's step runs its collectives there meanwhile); the reads' function is then not
    used, since running it in the writer thread would read on the mesh. Registry entry
    `checkpoint_snapshot`.

    Raises:
        NotImplementedError: an object saves through a registered saver (written by its
            own code at write time; not snapshotted).
    """
    checkpoint.save_counter  # noqa: B018 -- created before the object graph is read
    serialized, _, registered, _ = checkpoint._saver._gather_serialized_tensors(None)
    if registered:
        raise NotImplementedError(f"registered savers {sorted(registered)}")
    deferred = [(tensors, key) for tensors in serialized.values()
                for key, value in tensors.items() if isinstance(value, _tensor_callable.Callable)]
    read = _batched_reads(serialized, deferred, cache)
    if read is not None:
        for (tensors, key), value in zip(deferred, read):
            spec = tensors[key]
            tensors[key] = _saveable_object.SaveSpec(value, spec.slice_spec, spec.name,
                                                     dtype=spec.dtype, device=spec.device)
    on_mesh = []
    for tensors in serialized.values():
        for key, value in tensors.items():
            tensors[key] = ({spec: _read(v, to_host, on_mesh) for spec, v in value.items()}
                            if isinstance(value, dict) else _read(value, to_host, on_mesh))
    if on_mesh:
        cache["usable"] = False
    return serialized


def deferred_read(variable):
    """`variable` (a `tf.Variable`, not a DVariable) as a value of a trackable's
    `_serialize_to_tensors`, read when the checkpoint reads its values, as TensorFlow
    defers a variable's own read (`BaseResourceVariable._serialize_to_tensors`): by
    `snapshot`, with the other variables' reads in one `tf.function`; by a synchronous
    save, at its write. The read copies nothing (the host tensor shares the variable's
    buffer, which TensorFlow copies before updating it in place while a read holds it).
    Registry entry `checkpoint_snapshot`."""
    def read_variable():
        with tf.device(variable.device):
            value = variable.read_value()
        with tf.device("/cpu:0"):
            return tf.identity(value)
    return _tensor_callable.Callable(read_variable, dtype=variable.dtype,
                                     device=variable.device)


def _batched_reads(serialized, deferred, cache):
    """The deferred reads' values from one `tf.function`, or None where it does not apply
    (then each callable reads eagerly)."""
    objects = {id(tensors): trackable for trackable, tensors in serialized.items()}
    # The same objects, keys, and what each read captures (a variable's storage).
    signature = tuple((id(objects[id(tensors)]), key, _captured(tensors[key]))
                      for tensors, key in deferred)
    if cache.get("signature") != signature:
        callables = [tensors[key] for tensors, key in deferred]
        # The objects are held so that their ids in the signature stay theirs.
        cache.update(signature=signature, objects=list(serialized), usable=bool(deferred),
                     traced=False, read=tf.function(lambda: [c.tensor for c in callables]))
        return None
    if not (cache["usable"] and cache["traced"]):
        return None
    try:
        values = cache["read"]()
        cache["batched"] = cache.get("batched", 0) + 1  # saves read in one call so far
        return values
    except Exception as err:  # noqa: BLE001 -- e.g. an uninitialised variable; read eagerly
        logging.info("checkpoint reads in one function failed (%s); reading one by one", err)
        cache["usable"] = False
        return None


def _captured(spec):
    """The ids of the objects a deferred read's function reads from."""
    function = spec._tensor
    cells = getattr(function, "__closure__", None) or ()
    owner = getattr(function, "__self__", None) or getattr(function, "__code__", function)
    return (id(owner), *(id(cell.cell_contents) for cell in cells))


def trace_reads(cache):
    """Traces the reads' function of the latest `snapshot` with `cache` (seconds on a large
    model: off the training thread). Registry entry `checkpoint_snapshot`."""
    if cache.get("usable") and not cache.get("traced"):
        try:
            cache["read"]()  # traced, and instantiated by its first run (values unused)
            cache["traced"] = True
        except Exception as err:  # noqa: BLE001 -- reads stay eager
            logging.info("checkpoint reads in one function failed (%s); reading one by one",
                         err)
            cache["usable"] = False


def _read(value, to_host, on_mesh):
    """A SaveSpec whose tensor is read now (a variable's is a callable, read at write),
    on the host (a DTensor through `to_host`, its name appended to `on_mesh`)."""
    if isinstance(value, _saveable_object.SaveSpec):
        tensor = value.tensor
        if not (isinstance(tensor, tf.Tensor) and _dtensor.is_dtensor(tensor)):
            return _saveable_object.SaveSpec(tensor, value.slice_spec, value.name,
                                             dtype=value.dtype, device=value.device)
        # A DVariable's: its name and slice are string DTensors too.
        name, slice_spec = (_text(_host(t, to_host, on_mesh, "a DVariable's name"))
                            for t in (value.name, value.slice_spec))
        tensor = _host(tensor, to_host, on_mesh, name)
        return _saveable_object.SaveSpec(tensor, slice_spec, name, dtype=value.dtype,
                                         device=tensor.device)
    if isinstance(value, tf.Variable):  # would be read at write time
        value = value.read_value()
    return _host(value, to_host, on_mesh, getattr(value, "name", "?"))


def _text(value):
    """A string tensor's value as `str` (a `str` as it is)."""
    return value.numpy().decode() if isinstance(value, tf.Tensor) else value


def _host(tensor, to_host, on_mesh, name):
    if not (isinstance(tensor, tf.Tensor) and _dtensor.is_dtensor(tensor)):
        return tensor
    if to_host is None:
        raise NotImplementedError(f"{name} is a DTensor: give snapshot a to_host")
    on_mesh.append(name)
    with tf.device("/cpu:0"):
        return tf.constant(to_host(tensor))


def write(values, prefix):
    """Writes a `snapshot` as TensorFlow's checkpoint `prefix` (`prefix.index`,
    `prefix.data-*`). Registry entry `checkpoint_snapshot`."""
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    saver = _functional_saver.MultiDeviceSaver(values)
    with tf.device("/cpu:0"):
        path = tf.constant(prefix)
    # `snapshot`'s values are host tensors: the save runs on the host, synchronously, and
    # returns with its files complete. (No `async_wait` here: it would wait on every
    # executor of the process, a mesh's in-flight steps included.)
    saver.save(path)


def wait_for_files():
    """Returns once every save op dispatched so far has finished (DTensor's devices run
    them asynchronously; `tf.train.CheckpointManager.save` runs its write callbacks
    before it waits). Registry entry `checkpoint_snapshot`."""
    _context.async_wait()


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
