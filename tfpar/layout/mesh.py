"""The device mesh: `batch` × `model` axes over the local devices, as a Keras `DeviceMesh`.

Keras names the vocabulary (`keras.distribution.DeviceMesh`, `TensorLayout`) but its
TensorFlow side builds the DTensor mesh with `create_distributed_mesh`, which needs an
accelerator system even for logical CPUs. Here the DTensor mesh is built with
`dtensor.create_mesh` and attached to the Keras mesh, so `TensorLayout.backend_layout`
works unchanged.
"""

import os

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import devices as devices_lib
from tfpar import patches
from tfpar.dims import ParallelDims
from tfpar.errors import ConfigError

BATCH, MODEL = "batch", "model"

# DTensor's pass that merges independent all-reduces over the same devices into one (on by
# default), read once when DTensor starts. A mesh pipeline turns it off because it hangs
# (`tfpar.layout.pipeline`), ZeRO-3 because it keeps every layer's whole gradient alive
# until one merged reduction at the end of the backward pass (`tfpar.zero.fsdp`).
COMBINE_ALL_REDUCES = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"


def no_all_reduce_combining(setting, value, why):
    """Turns DTensor's all-reduce combining off for this process, before DTensor starts.

    Args:
        setting, value: the setting that needs it, for the error.
        why: what combining would do to that setting's runs, for the error.

    Raises:
        ConfigError: DTensor already started in this process with combining on (it reads
            the setting once).
    """
    if os.environ.get(COMBINE_ALL_REDUCES) == "0":
        return
    if patches.dtensor_started():
        raise ConfigError(
            setting, value,
            f"DTensor already started in this process with its all-reduce combining on "
            f"({why}); build this run before any other DTensor use in the process, or "
            f"start the process with {COMBINE_ALL_REDUCES}=0")
    os.environ[COMBINE_ALL_REDUCES] = "0"


def make_mesh(data_parallel, tensor_parallel, devices=None):
    """A `data_parallel` × `tensor_parallel` mesh with axes `("batch", "model")`.

    Devices are laid out row-major: the `tensor_parallel` devices of one model replica are
    neighbours (`/device:CPU:0..tp-1` form the first replica).

    Args:
        data_parallel: size of the `batch` axis; 0 means "all devices not used by
            tensor parallelism" (devices // tensor_parallel).
        tensor_parallel: size of the `model` axis.
        devices: device names to use, default every local compute device
            (`tfpar.devices.compute_devices()`).

    Returns:
        A `keras.distribution.DeviceMesh` whose `backend_mesh` is the DTensor mesh.

    Raises:
        ConfigError: the product of the degrees is not the number of devices.

    Examples:
        >>> mesh = make_mesh(2, 2)          # with 4 logical CPUs
        >>> mesh.shape
        (2, 2)
    """
    devices = list(devices or devices_lib.compute_devices())
    dims = ParallelDims(dp=data_parallel, tp=tensor_parallel).on_devices(len(devices))
    shape = (dims.dp, dims.tp)
    mesh = keras.distribution.DeviceMesh(shape, (BATCH, MODEL), devices=devices)
    patches.attach_backend_mesh(mesh, dtensor.create_mesh(list(zip((BATCH, MODEL), shape)),
                                                          devices=devices))
    return mesh


def attach_backend_mesh(device_mesh):
    """Gives a user's `keras.distribution.DeviceMesh` its DTensor mesh (in place), built
    with `dtensor.create_mesh` over its devices ("cpu:0" and "/device:CPU:0" alike), since
    Keras's own conversion needs an accelerator system even for CPUs. A mesh that already
    has one (from `make_mesh`, or under DTensor multi-client) is left alone. In a job of
    several processes (`tfpar.layout.multi_client`), the mesh spans every process's
    devices, process after process (`multi_client.global_devices`, what
    `keras.distribution.list_devices()` gives there).

    Returns:
        The DTensor mesh.

    Raises:
        ConfigError: across processes, the mesh is not over every device of every process
            in that order.
    """
    existing = patches.backend_mesh(device_mesh)
    if existing is not None:
        return existing
    if dtensor.num_clients() > 1:
        return patches.attach_backend_mesh(device_mesh, _distributed(device_mesh))
    names = []
    for device in np.asarray(device_mesh.devices).ravel():
        spec = tf.DeviceSpec.from_string(str(device) if "/" in str(device)
                                         else "/device:" + str(device))
        names.append(f"/device:{spec.device_type.upper()}:{spec.device_index}")
    return patches.attach_backend_mesh(device_mesh, dtensor.create_mesh(
        list(zip(device_mesh.axis_names, device_mesh.shape)), devices=names))


def _distributed(device_mesh):
    """The DTensor mesh of a `DeviceMesh` spanning the processes of a multi-client job."""
    flat = [str(d) for d in np.asarray(device_mesh.devices).ravel()]
    kind = tf.DeviceSpec.from_string(flat[0] if "/" in flat[0] else "/device:" + flat[0])
    kind = (kind.device_type or "CPU").upper()
    local = [f"{kind}:{i}" for i in range(len(dtensor.local_devices(kind)))]
    clients = dtensor.num_clients()
    ordered = [f"/job:{dtensor.job_name()}/replica:0/task:{t}/device:{kind}:{i}"
               for t in range(clients) for i in range(len(local))]
    if len(flat) != len(ordered) or any(
            "/task:" in name and tf.DeviceSpec.from_string(name).to_string()
            != tf.DeviceSpec.from_string(full).to_string() for name, full in zip(flat, ordered)):
        raise ConfigError("DeviceMesh.devices", f"{len(flat)} devices ({flat[0]}, …)",
                          f"a mesh across {clients} processes spans all their {len(ordered)} "
                          f"devices, process after process: keras.distribution.list_devices()")
    return dtensor.create_distributed_mesh(
        list(zip(device_mesh.axis_names, device_mesh.shape)), local_devices=local,
        device_type=kind)


def mesh_for_config(config, devices=None):
    """`make_mesh` from a `ParallelConfig`'s `data_parallel` and `tensor_parallel`."""
    return make_mesh(config.data_parallel, config.tensor_parallel, devices)


def axis_size(mesh, axis):
    """Devices along `axis` ("batch" or "model") of a Keras `DeviceMesh`."""
    return mesh.shape[list(mesh.axis_names).index(axis)]


def batch_axis(mesh):
    """The axis batches split over, of a Keras `DeviceMesh` or a DTensor mesh: the one
    named "batch", else the first (Keras's `DataParallel` and `ModelParallel` default to
    the first axis; keras.io's guide names it "data")."""
    names = list(mesh.axis_names if hasattr(mesh, "axis_names") else mesh.dim_names)
    return BATCH if BATCH in names else names[0]


def batch_parts(mesh):
    """Devices along the batch axis (`batch_axis`) of a Keras `DeviceMesh`."""
    return axis_size(mesh, batch_axis(mesh))


def replicated(mesh, rank):
    """The DTensor layout of a rank-`rank` tensor held whole on every device."""
    return dtensor.Layout.replicated(mesh.backend_mesh, rank)


def batch_sharded(mesh, rank):
    """The DTensor layout of a batch: first axis split over the batch axis, copies over the
    others."""
    return dtensor.Layout.batch_sharded(mesh.backend_mesh, batch_axis(mesh), rank)


def describe(mesh):
    """One line: `mesh batch=2 × model=2 over /device:CPU:0..3`; a mesh across processes
    (`tfpar.layout.multi_client`): `... over CPU:2..3 of each of 2 processes`."""
    flat = [str(d) for d in np.asarray(mesh.devices).ravel()]
    head = f"mesh {BATCH}={mesh.shape[0]} × {MODEL}={mesh.shape[1]} over "
    specs = [tf.DeviceSpec.from_string(d) for d in flat]
    tasks = sorted({spec.task for spec in specs})
    if len(tasks) > 1:
        indices = [spec.device_index for spec in specs]
        return (f"{head}{specs[0].device_type}:{min(indices)}..{max(indices)} of each of "
                f"{len(tasks)} processes")
    return head + devices_lib.span(flat)
