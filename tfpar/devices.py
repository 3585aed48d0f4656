"""Devices: logical CPU devices for simulation, device listing, a one-line topology report."""

import os

import tensorflow as tf

from tfpar.errors import ConfigError, TfparError


def split_cpu(n):
    """Splits the physical CPU into `n` logical devices, so data/tensor/pipeline parallelism
    can be tried without accelerators. Must run before TensorFlow initialises its devices.

    Args:
        n: number of logical CPU devices; 0 or 1 leaves the CPU as it is.

    Raises:
        TfparError: TensorFlow was already initialised with a different device count.
    """
    if n is None or n <= 1:
        return
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError as err:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise TfparError(
                f"cpu_devices={n} cannot be applied: TensorFlow already initialised with "
                f"{have} CPU device(s). Split the CPU before any TensorFlow op runs "
                f"({err}).") from None


def local_device_count(cpu_devices):
    """How many replicas this process can run, without initialising TensorFlow's runtime
    (a multi-worker strategy must be built before anything initialises it): the GPUs if
    there are any, else the `cpu_devices` logical CPUs (at least one)."""
    gpus = tf.config.list_physical_devices("GPU")
    return len(gpus) if gpus else max(1, cpu_devices)


def compute_devices():
    """Names of the local devices replicas run on: every GPU if there are any, else every
    (logical) CPU device."""
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [d.name for d in gpus]
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def check_device_count(setting, wanted):
    """Raises `ConfigError` unless `wanted` local devices exist."""
    have = len(compute_devices())
    if wanted > have:
        raise ConfigError(setting, wanted,
                          f"only {have} local device(s) exist; on CPU add --cpu_devices={wanted}")


def topology(strategy=None, workers=1):
    """One line for the run summary: device kind, count, replicas, workers, collective."""
    gpus = tf.config.list_physical_devices("GPU")
    kind = f"{len(gpus)} GPU" if gpus else (
        f"{len(tf.config.list_logical_devices('CPU'))} logical CPU on {os.cpu_count()} cores")
    parts = [f"devices: {kind}", f"workers: {workers}"]
    if strategy is not None:
        parts.append(f"strategy: {type(strategy).__name__}")
        parts.append(f"replicas: {strategy.num_replicas_in_sync}")
    return " | ".join(parts)


def span(devices):
    """Device names as one name: `/job:…/device:CPU:0..3` for consecutive logical devices."""
    if len(devices) == 1:
        return devices[0]
    prefix = devices[0].rstrip("0123456789")
    ids = [d[len(prefix):] for d in devices]
    if all(d.startswith(prefix) for d in devices) and ids == [str(i) for i in range(
            int(ids[0] or 0), int(ids[0] or 0) + len(ids))]:
        return f"{prefix}{ids[0]}..{ids[-1]}"
    return ", ".join(devices)

