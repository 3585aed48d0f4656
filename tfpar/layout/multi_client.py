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

>>> cluster = initialize(cpu_devices=2)       # before any other TensorFlow call
>>> mesh = distributed_mesh(data_parallel=2, tensor_parallel=2)
>>> model, trainer = build_on_mesh(mesh, rules, build_model, build_optimizer, loss)
"""

import os

import keras
from tensorflow.experimental import dtensor

from tfpar import tf_config
from tfpar.errors import ConfigError
from tfpar.layout.mesh import BATCH, MODEL


def dtensor_environment(cluster):
    """The `DTENSOR_*` variables for this process of `cluster` (a `tf_config.ClusterInfo`).

    Raises:
        ConfigError: this process is an evaluator (it holds no part of the mesh).
    """
    if cluster.worker_index is None:
        raise ConfigError("TF_CONFIG", f"task type {cluster.task_type!r}",
                          "a DTensor mesh spans training processes only (chief, worker)")
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


def distributed_mesh(data_parallel, tensor_parallel):
    """A `batch` × `model` Keras `DeviceMesh` over every client's devices
    (`data_parallel=0`: all devices the model axis leaves).

    Raises:
        ConfigError: the degrees do not multiply to the devices of all clients.
    """
    local = len(dtensor.local_devices("CPU"))
    total = local * dtensor.num_clients()
    if not data_parallel and tensor_parallel and total % tensor_parallel == 0:
        data_parallel = total // tensor_parallel  # 0: every device tensor parallelism leaves
    if data_parallel * tensor_parallel != total:
        raise ConfigError("data_parallel", data_parallel,
                          f"data_parallel × tensor_parallel = {data_parallel}×"
                          f"{tensor_parallel} must equal the {total} devices of "
                          f"{dtensor.num_clients()} processes × {local}")
    backend = dtensor.create_distributed_mesh(
        [(BATCH, data_parallel), (MODEL, tensor_parallel)], device_type="CPU")
    names = [f"/job:worker/replica:0/task:{i // local}/device:CPU:{i % local}"
             for i in range(total)]
    mesh = keras.distribution.DeviceMesh((data_parallel, tensor_parallel), (BATCH, MODEL),
                                         devices=names)
    mesh._backend_mesh = backend
    return mesh
