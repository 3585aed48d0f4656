"""A mesh across worker processes: DTensor multi-client, set up from `TF_CONFIG`.

Measured on TF 2.21 (2 processes × 2 logical CPUs): with `DTENSOR_JOBS` (every client's
`host:port`), `DTENSOR_CLIENT_ID`, `DTENSOR_NUM_CLIENTS` and `DTENSOR_JOB_NAME=worker`
set, `dtensor.initialize_accelerator_system("CPU")` joins the processes, and
`create_distributed_mesh([("batch", 2), ("model", 2)])` spans both: global devices are
numbered row-major, so each process holds one model replica (its devices form one row
of `model`) and data parallelism runs across processes.

Every process runs the same program on the same global batches; `values.to_mesh` packs
only the shards of the local devices. The `TF_CONFIG` that `tfpar.launch` (or a cluster
manager) sets is the only input: its training processes (chief first, then workers) are
the DTensor clients, at their `TF_CONFIG` addresses.

A pipeline across processes (dp × tp × pp, `stage_meshes`) gives every stage's mesh some
devices on every process rather than one stage per process: every client runs the same
program, and DTensor (TF 2.21) refuses a mesh with no device on this client ("Empty list of
devices not allowed", `dtensor.Mesh`); given its `global_devices`, such a mesh is accepted,
but a step that copies a value from stage 0's mesh (on process 0) to stage 1's (on process 1)
fails in SPMD expansion ("Send and receive hosts don't match", `DTensorRecv`). With each stage spread over all processes,
the pipeline's cross-mesh copies (replicated → replicated, `tfpar.layout.pipeline`) stay
inside each process, every process holds a copy of the losses on the last stage's mesh (so
host reads agree), and only the `batch` axis's reductions cross processes, as in
`distributed_mesh`. Measured with 2 processes × 4 logical CPUs, dp=2 × tp=2 × pp=2: the
weights after 5 steps are within 1.4e-7 of one device (tests/test_layout_pipeline_workers.py).

>>> cluster = initialize(cpu_devices=2)       # before any other TensorFlow call
>>> mesh = distributed_mesh(data_parallel=2, tensor_parallel=2)
>>> model, trainer = build_on_mesh(mesh, rules, build_model, build_optimizer, loss)

Keras's own API does the same after `tfpar.layout.enable()`: `keras.distribution.initialize()`
(`keras_initialize`) joins the processes, `keras.distribution.list_devices()` names every
process's devices (`global_devices`), and a `DeviceMesh` over them spans the processes:

>>> tfpar.devices.split_cpu(2); tfpar.layout.enable()
>>> keras.distribution.initialize()          # from TF_CONFIG, or job_addresses=...
>>> mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
...                                      devices=keras.distribution.list_devices())
"""

import os

import keras
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from tfpar import compat, patches, tf_config
from tfpar.dims import ParallelDims
from tfpar.errors import ConfigError
from tfpar.layout.mesh import BATCH, MODEL


def dtensor_environment(cluster):
    """The `DTENSOR_*` variables for this process of `cluster` (a `tf_config.ClusterInfo`).

    Raises:
        ConfigError: this process is an evaluator (it holds no part of the mesh).
    """
    compat.enforce(compat.DTENSOR_EVALUATOR, compat.view(backend="dtensor"), cluster)
    addresses = list(cluster.cluster.get("chief", [])) + list(cluster.cluster.get("worker", []))
    return {"DTENSOR_JOBS": ",".join(addresses),
            "DTENSOR_CLIENT_ID": str(cluster.worker_index),
            "DTENSOR_NUM_CLIENTS": str(len(addresses)),
            "DTENSOR_JOB_NAME": "worker"}


def initialize(cpu_devices=1, environ=None):
    """Joins this process to the DTensor clients its `TF_CONFIG` names.

    Call before TensorFlow initialises its devices (it splits the CPU itself).

    Args:
        cpu_devices: logical CPU devices in this process.
        environ: the environment to read `TF_CONFIG` from and write `DTENSOR_*` into
            (default `os.environ`).

    Returns:
        The `tf_config.ClusterInfo`, or None without `TF_CONFIG` (nothing is done).

    Raises:
        ConfigError: a bad `TF_CONFIG`, or this process is an evaluator.
    """
    environ = os.environ if environ is None else environ
    cluster = tf_config.load(environ)
    if cluster is None:
        return None
    dtensor_env = dtensor_environment(cluster)
    environ.update(dtensor_env)
    os.environ.update(dtensor_env)  # DTensor reads its settings from the process environment
    dtensor.initialize_accelerator_system(
        "CPU", num_logical_cpu_devices=cpu_devices if cpu_devices > 1 else None)
    return cluster


def keras_initialize(job_addresses=None, num_processes=None, process_id=None):
    """`keras.distribution.initialize` on TensorFlow (installed by `tfpar.layout.enable`):
    joins this process to the others as DTensor clients, before TensorFlow initialises its
    devices, and makes `keras.distribution.list_devices()` name every process's devices
    (`global_devices`).

    The processes are the arguments (or Keras's `KERAS_DISTRIBUTION_*` variables), else
    the training processes of `TF_CONFIG` (as `tfpar.launch` or a cluster manager sets
    it); with neither, a single process has nothing to join (logged). Each process keeps
    the logical CPUs it was split into (`tfpar.devices.split_cpu`).

    Raises:
        ConfigError: the arguments do not describe a cluster this process is part of, or a
            bad `TF_CONFIG`.
    """
    given = (job_addresses, num_processes, process_id)
    if all(v is None for v in given):
        if initialize(cpu_devices=_logical_cpus()) is None:
            logging.warning("keras.distribution.initialize: no TF_CONFIG and no "
                            "job_addresses; one process, nothing to join")
            return
    else:
        addresses = [a.strip() for a in str(job_addresses or "").split(",") if a.strip()]
        if num_processes != len(addresses) or process_id not in range(len(addresses)):
            raise ConfigError("job_addresses", job_addresses,
                              "give every process's host:port, num_processes (their "
                              f"number; got {num_processes}) and this process_id in 0 … "
                              f"num_processes - 1 (got {process_id}), or set TF_CONFIG")
        initialize(cpu_devices=_logical_cpus(),
                   environ={"TF_CONFIG": tf_config.make(addresses, process_id)})
    patches.set_list_devices(global_devices)


def _logical_cpus():
    configured = tf.config.get_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0])
    return len(configured or [None])


def global_devices(device_type=None):
    """Every client's devices of `device_type` ("cpu", "gpu"; default GPUs if there are
    any), by full name, client after client: the order `create_distributed_mesh` numbers
    them in, so a `DeviceMesh` over them lays `model` inside a process and `batch` across."""
    kind = (device_type or ("gpu" if tf.config.list_physical_devices("GPU") else "cpu")).upper()
    local = len(dtensor.local_devices(kind))
    return [f"/job:{dtensor.job_name()}/replica:0/task:{task}/device:{kind}:{i}"
            for task in range(dtensor.num_clients()) for i in range(local)]


def stage_meshes(data_parallel, tensor_parallel, stages):
    """One `batch` × `model` Keras `DeviceMesh` per pipeline stage, each spanning every
    client (`data_parallel=0`: all devices the model and stage axes leave).

    Every client gives each stage mesh n = data_parallel·tensor_parallel / clients of its
    devices, consecutive ones (stage s on this process's CPU:s·n … (s+1)·n − 1), and holds
    row-major mesh positions c·n … (c+1)·n − 1: with n a multiple of `tensor_parallel`, a
    model replica stays inside one process and `batch` runs across processes (see
    the module docstring for why a stage does not live on one process alone). Call
    `tfpar.layout.mesh.no_all_reduce_combining` before `initialize`.

    Raises:
        ConfigError: the degrees do not multiply to the devices of all clients, or a stage
            does not split evenly over the clients.
    """
    local = len(dtensor.local_devices("CPU"))
    clients = dtensor.num_clients()
    dims = ParallelDims(dp=data_parallel, tp=tensor_parallel, pp=stages,
                        workers=clients).on_devices(
        local * clients, f"devices of {clients} processes × {local}", cpu_hint=False)
    data_parallel, per_stage, n = dims.dp, dims.per_stage, dims.per_worker_stage()
    meshes = []
    for s in range(stages):
        backend = dtensor.create_distributed_mesh(
            [(BATCH, data_parallel), (MODEL, tensor_parallel)],
            mesh_name=f"stage{s}" if dims.pp_enabled else "",
            local_devices=[f"CPU:{s * n + i}" for i in range(n)], device_type="CPU")
        names = [f"/job:worker/replica:0/task:{i // n}/device:CPU:{s * n + i % n}"
                 for i in range(per_stage)]
        mesh = keras.distribution.DeviceMesh((data_parallel, tensor_parallel),
                                             (BATCH, MODEL), devices=names)
        patches.attach_backend_mesh(mesh, backend)
        meshes.append(mesh)
    return meshes


def distributed_mesh(data_parallel, tensor_parallel):
    """A `batch` × `model` Keras `DeviceMesh` over every client's devices
    (`data_parallel=0`: all devices the model axis leaves): `stage_meshes` with one stage.

    Raises:
        ConfigError: the degrees do not multiply to the devices of all clients.
    """
    return stage_meshes(data_parallel, tensor_parallel, 1)[0]
