"""Memory per device: allocator peaks and the bytes of the variables each device holds.

The allocator figures come from `tf.config.experimental.get_memory_info`. On CPU that
works only when TensorFlow's CPU allocator is the BFC allocator, which must be chosen
before TensorFlow starts (`TF_CPU_ALLOCATOR_USE_BFC=true`): `tfpar.train` sets it when it
is imported before TensorFlow (`python -m tfpar.train` always is); a Python caller that
imports TensorFlow first gets `None` for the allocator figures and a note saying why.

On CPU all logical devices split from one physical CPU share one allocator, so each
logical device reports the same figure: the peak of the whole process's CPU tensors, not
of one replica (the metrics JSON says so in `memory.peak_bytes_scope`). On GPUs each device
has its own allocator and the figure is that device's.

The variable figures (`param_bytes_per_device`, `optimizer_state_bytes_per_device`) count
where each variable's storage lives: a mirrored variable counts once on every device that
holds a copy, a variable placed on one device counts on that device only.
"""

import os
import re

import tensorflow as tf

from tfpar import patches
from tfpar.devices import span

ALLOCATOR_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
# The CPU BFC allocator's cap for the whole process, read by TensorFlow when it starts
# (its default: 64 GiB). Logical CPUs share that one allocator and its cap.
CPU_LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
CPU_LIMIT_DEFAULT_MB = 1 << 16


def allocator_note():
    """Why the allocator figures may be missing: `None` if they can be read."""
    if tf.config.list_physical_devices("GPU"):
        return None
    if os.environ.get(ALLOCATOR_ENV, "").lower() not in ("true", "1"):
        return (f"{ALLOCATOR_ENV}=true was not set before TensorFlow started; import "
                f"tfpar.train before tensorflow, or set it in the environment")
    return None


def device_memory(devices=None):
    """`(bytes, where)`: the memory one of `devices` (default every local device) can
    allocate, and a note saying where the figure comes from; `(None, why)` if unknown.

    GPUs: `nvidia-smi`'s total of the first. CPUs: the BFC allocator's cap (or the host's
    RAM if smaller) shared by the logical CPUs: the process's figure over their number.
    """
    devices = local_devices() if devices is None else devices
    if any("GPU" in d.upper() for d in devices):
        import shutil
        import subprocess
        if not shutil.which("nvidia-smi"):
            return None, "no nvidia-smi to read the GPUs' memory"
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20)
        totals = [int(x) for x in out.stdout.split() if x.isdigit()]
        if not totals:
            return None, "nvidia-smi reported no memory total"
        return min(totals) * 2 ** 20, "nvidia-smi memory.total"
    process, where = process_cpu_memory()
    n = max(1, len(devices))
    return process // n, where + (f", shared by {n} logical CPUs" if n > 1 else "")


def process_cpu_memory():
    """`(bytes, where)`: what this process's CPU allocator may hold: the BFC cap
    (`TF_CPU_BFC_MEM_LIMIT_IN_MB`) when BFC is on and the cap is below the host's RAM,
    else the host's RAM."""
    import psutil

    ram = int(psutil.virtual_memory().total)
    if os.environ.get(ALLOCATOR_ENV, "").lower() in ("true", "1"):
        mb = int(os.environ.get(CPU_LIMIT_ENV, CPU_LIMIT_DEFAULT_MB))
        if mb * 2 ** 20 < ram:
            return mb * 2 ** 20, f"the CPU allocator's cap {CPU_LIMIT_ENV}={mb}"
    return ram, "host RAM"


def _readable(device):
    try:
        tf.config.experimental.get_memory_info(device)
        return True
    except (ValueError, tf.errors.OpError):
        return False


def local_devices():
    """Names of the local devices replicas run on (GPUs, else every logical CPU)."""
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def reset_peaks(devices=None):
    """Resets the allocator peak of `devices` (default: every local device); returns the
    bytes in use on each right after, or `None` if the allocator cannot be read."""
    devices = local_devices() if devices is None else devices
    if not all(_readable(d) for d in devices):
        return None
    for device in devices:
        tf.config.experimental.reset_memory_stats(device)
    return [int(tf.config.experimental.get_memory_info(d)["current"]) for d in devices]


def peak_bytes(devices=None):
    """The allocator peak of each of `devices` since the last reset, or `None`."""
    devices = local_devices() if devices is None else devices
    if not all(_readable(d) for d in devices):
        return None
    return [int(tf.config.experimental.get_memory_info(d)["peak"]) for d in devices]


def shares_allocator(devices=None):
    """Whether `devices` are logical devices over one physical CPU (one allocator)."""
    devices = local_devices() if devices is None else devices
    return len(devices) > 1 and all(tf.DeviceSpec.from_string(d).device_type == "CPU"
                                    for d in devices)


def _components(variable):
    """The (device, tf.Variable) storages behind a Keras or TensorFlow variable."""
    if isinstance(variable, tf.distribute.DistributedValues):  # tf_keras under a strategy
        return list(variable.values)
    if isinstance(variable, tf.Variable):
        return [variable]
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    inner = patches.variable_storage(variable)
    if isinstance(inner, tf.distribute.DistributedValues):
        return list(inner.values)
    return [inner if isinstance(inner, tf.Variable) else value]


def _canonical(name):
    spec = tf.DeviceSpec.from_string(name)
    return (spec.device_type or "CPU", spec.device_index or 0)


def variable_bytes_per_device(variables, devices=None):
    """Bytes of `variables` stored on each of `devices` (default: every local device).

    A mirrored variable counts on each device holding a copy; a variable with no device
    (eager, unplaced) counts on the first device.
    """
    devices = local_devices() if devices is None else devices
    index = {_canonical(d): i for i, d in enumerate(devices)}
    out = [0] * len(devices)
    seen = set()
    for variable in variables:
        for part in _components(variable):
            if id(part) in seen:
                continue
            seen.add(id(part))
            size = int(part.shape.num_elements() or 0) * part.dtype.size
            where = index.get(_canonical(part.device), 0) if part.device else 0
            out[where] += size
    return out


def optimizer_variables(model):
    """The optimizer state of `model`: its optimizer's variables (with ZeRO, the sharded
    slots: each device's piece counts on that device, and with Adam in front of its codec
    the aggregator's whole moments and residuals), or every stage optimizer's for a
    `PipelineModel`."""
    from tfpar.zero import sharded as zero
    stage_optimizers = getattr(model, "stage_optimizers", None)
    optimizers = stage_optimizers or [model.optimizer]
    out = []
    for opt in optimizers:
        if opt is None:
            continue
        variables = opt.variables
        out += list(variables() if callable(variables) else variables)  # tf_keras: a method
        out += zero.state_variables(opt)
    return out


def shard_bytes_per_device(variables, devices):
    """Bytes of the local shard of each DTensor variable (DVariable, or a Keras variable
    whose value is one) on each of `devices`, the mesh's devices in its order: a variable
    split over k devices counts 1/k of its bytes on each, a replicated one all of them."""
    from tensorflow.experimental import dtensor

    out = [0] * len(devices)
    for variable in variables:
        value = getattr(variable, "value", variable)
        for i, shard in enumerate(dtensor.unpack(value.read_value())):
            out[i] += int(shard.shape.num_elements() or 0) * shard.dtype.size
    return out


def memory_block(model, start_bytes=None, devices=None, param_bytes=None,
                 optimizer_state_bytes=None):
    """The allocator and variable keys the metrics JSON's `memory` block gains.

    Args:
        model: the trained model (Keras, tf_keras or `PipelineModel`).
        start_bytes: what `reset_peaks` returned before training (bytes in use per device
            when the peak was reset), or `None`.
        devices: the devices to report (default every local device).
        param_bytes, optimizer_state_bytes: the variable bytes per device when the caller
            measured them (a DTensor mesh: `shard_bytes_per_device`); default: counted
            from where `model`'s variables live.
    """
    devices = local_devices() if devices is None else devices
    if param_bytes is None:
        param_bytes = variable_bytes_per_device(model.weights, devices)
    if optimizer_state_bytes is None:
        optimizer_state_bytes = variable_bytes_per_device(optimizer_variables(model),
                                                          devices)
    out = {"devices": devices, "param_bytes_per_device": param_bytes,
           "optimizer_state_bytes_per_device": optimizer_state_bytes}
    peaks = peak_bytes(devices)
    out["peak_bytes_per_device"] = peaks
    if peaks is None:
        out["peak_bytes_note"] = allocator_note() or "the allocator of these devices " \
                                                     "reports no statistics"
        return out
    out["peak_bytes_scope"] = ("process" if shares_allocator(devices) else "device")
    if start_bytes is not None:
        # The training peak above what was resident when training began (weights, slots,
        # data buffers): activations, gradients and temporaries of a step.
        out["peak_bytes_above_start_per_device"] = [p - s for p, s in zip(peaks, start_bytes)]
    return out


_OOM_TEXT = re.compile(r"\bOOM\b|ResourceExhausted|[Oo]ut of memory|exceeds \d+% of free")


def is_out_of_memory(err, devices=None):
    """Whether TensorFlow error `err` comes from a device running out of memory: a
    `ResourceExhaustedError`, an error whose message says so, or (a DTensor mesh, where the
    device that ran out cancels its peers' collectives and the step reports the cancelled
    collective) any error while the CPU allocator's peak reached within 1 MB of its cap."""
    if isinstance(err, tf.errors.ResourceExhaustedError):
        return True
    if _OOM_TEXT.search(getattr(err, "message", None) or str(err)):
        return True
    devices = local_devices() if devices is None else devices
    if any("GPU" in d.upper() for d in devices) or not _readable(devices[0]):
        return False
    available, where = process_cpu_memory()
    if "cap" not in where:
        return False
    peak = int(tf.config.experimental.get_memory_info(devices[0])["peak"])
    return peak >= available - 2 ** 20


def out_of_memory_error(err, config, replicas, devices=None):
    """`err` (a `tf.errors.ResourceExhaustedError`) as a `tfpar.oom.OutOfMemoryError` whose
    message is one line: the device, the bytes, settings that would fit."""
    from tfpar import oom

    devices = local_devices() if devices is None else devices
    device, _ = oom.parse(getattr(err, "message", None) or str(err))
    on_cpu = not any("GPU" in d.upper() for d in devices)
    if on_cpu:  # one allocator for the process: its figures, not one logical device's
        available, where = process_cpu_memory()
    else:
        available, where = device_memory(devices)
    in_use = None
    try:
        in_use = int(tf.config.experimental.get_memory_info(
            device if device and not on_cpu else devices[0])["current"])
    except (ValueError, tf.errors.OpError):
        pass
    if on_cpu and len(devices) > 1:
        # The planner's estimate is per device; the process holds every logical device's.
        available, in_use = available // len(devices), (in_use or 0) // len(devices) or None
        where += f", shared by {len(devices)} logical CPUs"
    return oom.OutOfMemoryError(oom.explain(err, config, replicas, len(devices),
                                            in_use=in_use, available=available,
                                            where=where, device=span(devices)))
