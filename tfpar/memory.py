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

import tensorflow as tf

ALLOCATOR_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


def allocator_note():
    """Why the allocator figures may be missing: `None` if they can be read."""
    if tf.config.list_physical_devices("GPU"):
        return None
    if os.environ.get(ALLOCATOR_ENV, "").lower() not in ("true", "1"):
        return (f"{ALLOCATOR_ENV}=true was not set before TensorFlow started; import "
                f"tfpar.train before tensorflow, or set it in the environment")
    return None


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
    if isinstance(variable, tf.distribute.DistributedValues):
        return list(variable.values)
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    inner = getattr(variable, "_value", None)
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
    slots: each device's piece counts on that device), or every stage optimizer's for a
    `PipelineModel`."""
    from tfpar import zero
    stage_optimizers = getattr(model, "stage_optimizers", None)
    optimizers = stage_optimizers or [model.optimizer]
    return [v for opt in optimizers if opt is not None
            for v in [*opt.variables, *zero.state_variables(opt)]]


def memory_block(model, start_bytes=None):
    """The allocator and variable keys the metrics JSON's `memory` block gains.

    Args:
        model: the trained model (Keras or `PipelineModel`).
        start_bytes: what `reset_peaks` returned before training (bytes in use per device
            when the peak was reset), or `None`.
    """
    devices = local_devices()
    out = {"devices": devices,
           "param_bytes_per_device": variable_bytes_per_device(model.weights, devices),
           "optimizer_state_bytes_per_device": variable_bytes_per_device(
               optimizer_variables(model), devices)}
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
