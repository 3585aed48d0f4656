"""An out-of-memory run ends with one line: the device, the bytes, settings that would fit.

`tfpar.train.train` turns TensorFlow's `ResourceExhaustedError` into `OutOfMemoryError`
(a `TfparError`, printed as one line by `python -m tfpar.train`, never a stack trace):

    out of memory on /job:localhost/replica:0/task:0/device:CPU:0: 1.5 MB more with
    60.2 MB in use, 64.0 MB available (the process's CPU allocator cap,
    TF_CPU_BFC_MEM_LIMIT_IN_MB=64); would fit by tfpar.plan's memory model: ...

The settings suggested are variants of the run's config that `tfpar.compat` accepts (so
each is a command that runs), ranked by what they cost in step time (recomputation first,
then ZeRO stages, accumulation, `--offload=optimizer` with the optimizer state's bytes it
takes off each device, tensor parallelism, a smaller batch), whose memory by
`tfpar.plan.cost.memory_bytes` scaled to this run fits: the model's estimate of the
failed config is taken to be what the run had in use when it failed (a lower bound of
what it needed), and a variant fits if its estimate on that scale is under the device's
memory.
"""

import re

from tfpar.errors import ConfigError, TfparError

OFFLOAD_FLAG = "--offload=optimizer"

_DTYPE_BYTES = {"float": 4, "float32": 4, "int32": 4, "double": 8, "float64": 8,
                "int64": 8, "half": 2, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
                "bool": 1}


class OutOfMemoryError(TfparError):
    """A device ran out of memory; the message is the one line described in `tfpar.oom`."""


def parse(message):
    """`(device, bytes)` of TensorFlow's OOM message (`None` for what it does not say)."""
    device = re.search(r" on (/\S+|[A-Z]+:\d+)", message)
    device = device.group(1).rstrip(",.") if device else None
    size = None
    shape = re.search(r"shape\s*\[([\d,\s]*)\]\s+and\s+type\s+(\w+)", message)
    if shape:
        dims = [int(d) for d in shape.group(1).replace(" ", "").split(",") if d]
        count = 1
        for d in dims:
            count *= d
        size = count * _DTYPE_BYTES.get(shape.group(2), 4)
    else:
        mib = re.search(r"allocate ([\d.]+)([KMG])iB", message)
        if mib:
            size = int(float(mib.group(1)) * {"K": 2 ** 10, "M": 2 ** 20,
                                              "G": 2 ** 30}[mib.group(2)])
    return device, size


def _mb(n):
    if n < 0.1 * 2 ** 20:  # "0.0 MB more" says nothing
        return f"{n / 2 ** 10:.1f} kB"
    return f"{n / 2 ** 20:.1f} MB"


def variants(config, replicas, devices):
    """`(flags, config)` of settings to try, most step time kept first; only those
    `tfpar.compat` accepts (ConfigError: skipped)."""
    out = []

    def add(flags, **changes):
        try:
            out.append((flags, config.replace(**changes)))
        except (ConfigError, ValueError, TypeError):
            pass

    # ZeRO-3 already recomputes every layer it gathers (tfpar.zero.fsdp).
    recompute = config.recompute == "none" and config.zero_stage < 3
    if recompute:
        add("--recompute=blocks", recompute="blocks")
    if replicas > 1:
        for stage in range(max(1, config.zero_stage + 1), 4):
            add(f"--zero_stage={stage}", zero_stage=stage)
    per_replica = config.global_batch_size // max(1, replicas)
    for k in (2, 4, 8):
        accum = config.grad_accum_steps * k
        if per_replica % accum == 0 and not config.dims.pp_enabled:
            add(f"--grad_accum_steps={accum}", grad_accum_steps=accum)
    if config.offload == "none":  # compat: momentum or Adam, data parallel or ZeRO 1/2
        add(OFFLOAD_FLAG, offload="optimizer")
    for tp in (2, 4):
        if tp > config.tensor_parallel and devices % tp == 0 and not config.dims.pp_enabled:
            add(f"--tensor_parallel={tp} --data_parallel={devices // tp}",
                tensor_parallel=tp, data_parallel=devices // tp)
    if recompute and replicas > 1:
        add("--recompute=blocks --zero_stage=3", recompute="blocks", zero_stage=3)
    for div in (2, 4):
        batch = config.global_batch_size // div
        if batch >= replicas and batch % max(1, replicas) == 0:
            add(f"--global_batch_size={batch}", global_batch_size=batch)
    return out


def estimate(config, replicas):
    """Bytes per device of `config` with `replicas` data-parallel replicas by
    `tfpar.plan.cost` (None for models it cannot profile)."""
    from tfpar.plan import cost, profile

    try:
        prof = profile.builtin_profile(config.model, config.model_width, config.model_depth)
    except Exception:  # a model the planner has no formula for: no estimate
        return None
    data = max(1, replicas)
    micro = config.microbatches if config.dims.pp_enabled else config.grad_accum_steps
    candidate = cost.Candidate(data, config.tensor_parallel, config.pipeline_stages, micro,
                               config.compression, config.virtual_stages,
                               config.recompute != "none", config.zero_stage,
                               config.offload != "none")
    return cost.memory_bytes(prof, candidate, config.global_batch_size, config.optimizer,
                             config.schedule)


def explain(err, config, replicas, devices, in_use=None, available=None, where="",
            device=None):
    """The one line for out-of-memory error `err` of a run of `config`.

    Args:
        err: the `tf.errors.ResourceExhaustedError` (or its message).
        config: the run's `ParallelConfig`; replicas: its data-parallel replicas;
            devices: the local devices it runs on.
        in_use: bytes the allocator held on the device when it failed (None: unknown).
        available: the device's memory in bytes (None: unknown), and `where` it comes from.
        device: the device(s) to name when the message names none (on a mesh the step
            reports a cancelled collective, not the allocation that failed).
    """
    message = getattr(err, "message", None) or str(err)
    named, size = parse(message)
    device = named or device
    line = f"out of memory on {device or 'a device'}"
    facts = []
    if size:
        facts.append(f"{_mb(size)} more")
    if in_use:
        facts.append(f"with {_mb(in_use)} in use")
    if available:
        facts.append(f"{_mb(available)} available" + (f" ({where})" if where else ""))
    if facts:
        line += ": " + ", ".join(facts)
    fits = _fitting(config, replicas, devices, (in_use or 0) + (size or 0), available)
    if fits:
        line += "; would fit by tfpar.plan's memory model: " + "; or ".join(fits)
    else:
        line += ("; lower --global_batch_size or add devices (python -m tfpar.plan "
                 "--memory_gb=... ranks layouts by memory)")
    return line


def _fitting(config, replicas, devices, needed, available, most=3):
    base = estimate(config, replicas)
    if not base or not available:
        return []
    scale = max(needed, available) / base  # the failed config at least filled the device
    out = []
    for flags, variant in variants(config, replicas, devices):
        v_replicas = (devices // variant.tensor_parallel
                      if variant.tensor_parallel != config.tensor_parallel else replicas)
        need = estimate(variant, v_replicas)
        if need is not None and need * scale <= available:
            if flags == OFFLOAD_FLAG:  # what leaves the device, by the same model
                flags += (f" (the optimizer state, {_mb(base - need)} a device, to host "
                          "memory; a host update each step)")
            out.append(flags)
            if len(out) == most:
                break
    return out
