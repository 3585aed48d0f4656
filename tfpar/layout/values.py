"""Moving values between the host and the mesh.

DTensor values cannot be read with `numpy()` when they are sharded, and a DVariable
cannot be assigned a host array directly: the value has to be put onto the variable's
layout first. These functions do each move in one place.
"""

import math

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar.errors import ConfigError
from tfpar.layout import mesh as mesh_lib


def to_mesh(array, layout):
    """`array` (numpy or a plain tensor) as a DTensor with `layout`.

    A layout split along one dimension (a batch, micro-batches, most weights) is packed
    from slices, so no device holds the whole array; any other layout is copied whole to
    the mesh and then split.

    Args:
        array: a host value whose shape fits `layout`.
        layout: a `dtensor.Layout`.

    Returns:
        A DTensor.
    """
    array = np.asarray(array) if not isinstance(array, tf.Tensor) else array
    specs = layout.sharding_specs
    mesh = layout.mesh
    split = [i for i, s in enumerate(specs) if s != dtensor.UNSHARDED]
    if len(split) == 1:  # e.g. a batch, micro-batches (k, batch, ...), a column split
        dim = split[0]
        parts = mesh.dim_size(specs[dim])
        size = array.shape[dim] // parts
        coords = [mesh.device_location(i)[mesh.dim_names.index(specs[dim])]
                  for i in mesh.local_device_ids()]
        index = (slice(None),) * dim
        return dtensor.pack([array[index + (slice(c * size, (c + 1) * size),)]
                             for c in coords], layout)
    whole = dtensor.copy_to_mesh(tf.convert_to_tensor(array),
                                 dtensor.Layout.replicated(mesh, len(specs)))
    return whole if layout.is_fully_replicated() else dtensor.relayout(whole, layout)


def to_host(value):
    """A DTensor (or DVariable, or plain tensor) as a numpy array, gathered if sharded."""
    if isinstance(value, tf.Variable):
        value = value.read_value()
    if not dtensor.is_dtensor(value):
        return np.asarray(value)
    layout = dtensor.fetch_layout(value)
    if not layout.is_fully_replicated():
        value = dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return dtensor.unpack(value)[0].numpy()


def sum_over_devices(value, mesh):
    """`value` put on each of this process's devices of `mesh` (a Keras `DeviceMesh`),
    summed over all of the mesh's devices, as a float. On a mesh spanning several processes
    every process must call it at the same point, each with its own `value`: the sum is
    one all-reduce over them (e.g. whether any process was signalled): with 4 devices,
    one process, `sum_over_devices(1.0, mesh)` is 4.0.
    """
    backend = mesh.backend_mesh
    shape = [backend.dim_size(name) for name in backend.dim_names]
    layout = dtensor.Layout(list(backend.dim_names), backend)  # one element per device
    local = [tf.fill([1] * len(shape), tf.constant(float(value)))
             for _ in backend.local_device_ids()]
    return float(to_host(tf.reduce_sum(dtensor.pack(local, layout))))


def assign(variable, array):
    """Assigns a host `array` to a Keras variable whose value is a DVariable."""
    dvariable = variable.value if isinstance(variable, keras.Variable) else variable
    layout = dtensor.fetch_layout(dvariable)
    dvariable.assign(to_mesh(np.asarray(array, dtype=dvariable.dtype.as_numpy_dtype), layout))


def batch_to_mesh(batch, mesh):
    """A tuple (x, y[, sample_weight]) of host arrays, or of structures of them (dicts,
    lists: a model's several inputs, outputs, sample weights), each array split on the
    `batch` mesh axis; the structure is kept.

    Raises:
        ConfigError: the batch size does not split over the `batch` axis.
    """
    leaves = _batch_arrays(keras.tree.flatten(batch), mesh_lib.batch_parts(mesh))
    on_mesh = [to_mesh(array, mesh_lib.batch_sharded(mesh, array.ndim)) for array in leaves]
    return tuple(keras.tree.pack_sequence_as(batch, on_mesh))


def replica_batches_to_mesh(batch, mesh):
    """A tuple (x, y[, sample_weight]) of host arrays, or of structures of them, as
    `[data_parallel, m, ...]` DTensors split on the `batch` axis: row r is replica r's
    part of the batch (for a step that forms each replica's gradient,
    `tfpar.layout.reduction`); the structure is kept.

    Raises:
        ConfigError: the batch size does not split over the `batch` axis.
    """
    parts = mesh_lib.batch_parts(mesh)
    out = []
    for array in _batch_arrays(keras.tree.flatten(batch), parts):
        stacked = array.reshape((parts, -1) + array.shape[1:])
        out.append(to_mesh(stacked, mesh_lib.batch_sharded(mesh, stacked.ndim)))
    return tuple(keras.tree.pack_sequence_as(batch, out))


def micro_replica_batches_to_mesh(batch, mesh, steps):
    """`replica_batches_to_mesh` of each of `steps` micro-batches (rows `i*m … (i+1)*m-1`
    being micro-batch i, as `micro_batches_to_mesh` cuts them): each array becomes a tuple
    of `steps` DTensors `[data_parallel, m / data_parallel, ...]`.

    Raises:
        ConfigError: the batch does not split into `steps` micro-batches that each split
            over the `batch` axis.
    """
    parts = mesh_lib.batch_parts(mesh)
    arrays = [np.asarray(array) for array in batch]
    for array in arrays:
        if array.shape[0] % (steps * parts):
            raise ConfigError("grad_accum_steps", steps,
                              f"the batch of {array.shape[0]} must split into {steps} "
                              f"micro-batches divisible by data_parallel={parts}; use a "
                              f"batch that is a multiple of {steps * parts}")
    return tuple(tuple(replica_batches_to_mesh((micro,), mesh)[0]
                       for micro in np.split(array, steps)) for array in arrays)


def _batch_arrays(batch, parts):
    """`batch`'s arrays as numpy, each checked to split into `parts` equal rows."""
    arrays = [np.asarray(array) for array in batch]
    for array in arrays:
        if array.shape[0] % parts:
            raise ConfigError("global_batch_size", array.shape[0],
                              f"must be divisible by data_parallel={parts} (a mesh shards the "
                              "batch axis in equal parts)")
    return arrays


def micro_batches_to_mesh(batch, mesh, steps):
    """A tuple of host arrays (x, y[, sample_weight]) cut into `steps` micro-batches, rows
    `i*m … (i+1)*m-1` being micro-batch i: each array becomes a tuple of `steps` DTensors,
    each split on the `batch` mesh axis. (Slicing one `(steps, m, ...)` DTensor inside the
    step instead gives wrong layouts on TF 2.21: a `StridedSlice` that drops the first
    axis keeps the split on the second.)

    Raises:
        ConfigError: the batch does not split into `steps` micro-batches that each split
            over the `batch` axis.
    """
    parts = mesh_lib.batch_parts(mesh)
    out = []
    for array in batch:
        array = np.asarray(array)
        if array.shape[0] % (steps * parts):
            raise ConfigError("grad_accum_steps", steps,
                              f"the batch of {array.shape[0]} must split into {steps} "
                              f"micro-batches divisible by data_parallel={parts}; use a "
                              f"batch that is a multiple of {steps * parts}")
        out.append(tuple(to_mesh(micro, mesh_lib.batch_sharded(mesh, array.ndim))
                         for micro in np.split(array, steps)))
    return tuple(out)


def shard_sizes(variables):
    """Elements each local device holds of `variables`, measured from the shards.

    Args:
        variables: Keras variables whose values are DVariables.

    Returns:
        A list with one element count per device of the mesh.
    """
    counts = None
    for variable in variables:
        dvariable = variable.value if isinstance(variable, keras.Variable) else variable
        sizes = [math.prod(t.shape) for t in dtensor.unpack(dvariable.read_value())]
        counts = sizes if counts is None else [a + b for a, b in zip(counts, sizes)]
    return counts or []
