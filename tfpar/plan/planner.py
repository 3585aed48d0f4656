"""The planner: rank every layout the cost model allows, explain the winner and why each
neighbour lost, and say how to run it (`tfpar.plan.commands`: a `python -m tfpar.train`
command when the trainer runs that layout today, and the Python calls for the user's own
script)."""

import dataclasses
import time

from absl import logging

from tfpar.errors import ConfigError, TfparError
from tfpar.plan import calibration, commands, cost, profile

PARTS = ("overhead", "compute", "bubble", "data_parallel", "tensor_parallel", "pipeline_p2p")


@dataclasses.dataclass(frozen=True)
class Request:
    """What to plan: the model's name (as `--model` gave it), the training settings that
    change the cost, and pins (0, 1 or "none": free; otherwise only that value).

    Args:
        model: `mlp`, `convnet`, `transformer` or `module:function`.
        trainer_builds_it: `python -m tfpar.train --model=... --model_width --model_depth`
            builds exactly the profiled model (False for other shapes and user models).
        schedule: the pipeline's schedule; "auto" ranks 1F1B and Chimera (each priced by
            its simulated bubble, Chimera with two copies of each stage's weights).
        recompute: "auto" (with and without activation recomputation), "on" or "off";
            zero: ZeRO stages to try. Whether `tfpar.train` runs a layout is
            `tfpar.compat`'s answer (`commands.runnable`); one it refuses is marked with
            the reason, never given a command.
    """

    model: str = "mlp"
    model_width: int = 0
    model_depth: int = 0
    trainer_builds_it: bool = True
    global_batch_size: int = 64
    optimizer: str = "adam"
    schedule: str = "auto"
    mixed_precision: str = "none"
    data_parallel: int = 0
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    compression: str = "none"
    recompute: str = "auto"
    zero: tuple = (0,)
    simulated_cpu: bool = False

    @classmethod
    def from_config(cls, config, **changes):
        """A request from a `tfpar.ParallelConfig` (its model, batch, optimizer, schedule,
        precision and pinned degrees): the config's schedule (1F1B by default), not the
        planner's `auto`, so Chimera is ranked only when asked for (`schedule="auto"`
        in `changes`)."""
        fields = ("model", "model_width", "model_depth", "global_batch_size", "optimizer",
                  "schedule", "mixed_precision", "data_parallel", "tensor_parallel",
                  "pipeline_stages", "compression")
        return cls(**{**{f: getattr(config, f) for f in fields}, **changes})


def hardware_from(devices, memory_gb, tflops, intra_gbps, inter_gbps, devices_per_machine=0,
                  latency_us=20.0, memory_gbps=0.0, dp_overlap=0.0):
    """A `cost.Hardware` from the units people quote (GB, TFLOP/s, Gbit/s per device, µs
    per collective step, GB/s of device memory; 0: unknown), and the share of the gradient
    all-reduce a run measured hidden behind backward (`comm.overlap_fraction`).

    Raises:
        ConfigError: no devices given.
    """
    if devices < 1:
        raise ConfigError("devices", devices, "give the number of devices to plan for (>= 1)")
    return cost.Hardware(devices=devices, memory_bytes=memory_gb * 1e9, flops=tflops * 1e12,
                         intra_bandwidth=intra_gbps * 1e9 / 8,
                         inter_bandwidth=inter_gbps * 1e9 / 8,
                         devices_per_machine=devices_per_machine, latency=latency_us * 1e-6,
                         memory_bandwidth=memory_gbps * 1e9, dp_overlap=dp_overlap)


def calibrate(config, devices, steps=30):
    """Measures this machine for the cost model, on `devices` logical CPUs.

    Links: the bus bandwidth and per-message latency of an all-reduce over the devices, and
    the matmul rate with every device busy. Then the per-unit costs (seconds per FLOP, per
    step, per parameter updated, per pipeline action, per parameter each aggregator
    encodes) are fitted to short real training runs of `config.model` at batches other than
    `config.global_batch_size` (see `tfpar.plan.calibration`); about 2 minutes on 2 cores.

    Call in a process that has not initialised TensorFlow yet (it splits the CPU).

    Returns:
        `(hardware, report)`: the calibrated `cost.Hardware`, and a JSON-able dict with the
        link measurements and each calibration run (layout, batch, measured and fitted ms).

    Raises:
        TfparError: a calibration run failed.
    """
    hw, matmul_flops = measure_links(devices)
    prof = profile.builtin_profile(config.model, config.model_width, config.model_depth)
    observations = []
    for candidate, batch in calibration.calibration_runs(prof, devices,
                                                         config.global_batch_size):
        seconds = calibration.measure_run(config, candidate, batch, devices, steps)
        logging.info("calibration: %s batch %d: %.2f ms", label(dataclasses.asdict(candidate)),
                     batch, 1000 * seconds)
        observations.append((candidate, batch, seconds))
    hw, predicted = calibration.fit(prof, hw, observations)
    if hw.flops == float("inf"):  # no compute visible above the noise: use the matmul rate
        hw = dataclasses.replace(hw, flops=matmul_flops)
    runs = [{**dataclasses.asdict(c), "global_batch_size": batch, "measured_ms": 1000 * s,
             "fitted_ms": 1000 * p} for (c, batch, s), p in zip(observations, predicted)]
    return hw, {"matmul_flops": matmul_flops, "runs": runs}


def measure_links(devices, matmul=1024, allreduce_mb=16):
    """`(hardware, matmul_flops)`: a `cost.Hardware` with the all-reduce bandwidth and
    latency over `devices` logical CPUs, memory per device, and the matmul rate of one
    device while all run matmuls at once as its FLOP/s (until calibration fits it)."""
    import psutil
    import tensorflow as tf

    from tfpar import devices as devices_lib
    from tfpar import memory as memory_lib

    devices_lib.split_cpu(devices)
    a = tf.random.normal([matmul, matmul])
    names = devices_lib.compute_devices()[:devices]

    @tf.function
    def step(a):
        # Every device at once: logical devices may share cores, and a step keeps all busy.
        outs = []
        for name in names:
            with tf.device(name):
                outs.append(tf.reduce_sum(tf.matmul(a, a)))
        return tf.add_n(outs)

    step(a).numpy()
    began, reps = time.perf_counter(), 10
    for _ in range(reps):
        out = step(a)
    out.numpy()
    flops = 2 * matmul ** 3 * reps / (time.perf_counter() - began)  # per device
    bandwidth, latency = 1e9, 0.0
    if devices > 1:
        strategy = tf.distribute.MirroredStrategy(devices_lib.compute_devices()[:devices])
        size = allreduce_mb * 2 ** 20 // 4
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.ones([size]))
        reduce = tf.function(lambda v: strategy.run(
            lambda x: tf.distribute.get_replica_context().all_reduce("SUM", x), args=(v,)))
        reduce(values)
        began = time.perf_counter()
        for _ in range(3):
            result = reduce(values)
        strategy.experimental_local_results(result)[0].numpy()
        seconds = (time.perf_counter() - began) / 3
        bandwidth = 2 * (devices - 1) / devices * size * 4 / seconds
        tiny = strategy.experimental_distribute_values_from_function(lambda ctx: tf.ones([1]))
        reduce(tiny)
        began = time.perf_counter()
        for _ in range(20):
            result = reduce(tiny)
            strategy.experimental_local_results(result)[0].numpy()
        latency = (time.perf_counter() - began) / 20 / (2 * (devices - 1))
    # What one device can allocate (the CPU allocator's cap or RAM, shared by the
    # logical CPUs), not the host's RAM alone.
    memory = memory_lib.device_memory(names)[0] or psutil.virtual_memory().total / devices
    return cost.Hardware(devices=devices, memory_bytes=memory, flops=flops,
                         intra_bandwidth=bandwidth, inter_bandwidth=bandwidth,
                         latency=latency, shared_cores=True), flops


def plan(prof, hw, request):
    """Ranks every layout of the model `prof` describes on `hw`; returns a JSON-able dict:
    `recommended` (the fastest layout that fits, its reasons and neighbours), `runnable`
    (the fastest that `tfpar.train` runs today, with its command), `layouts` (the best
    variant of each data × tensor × pipeline split, fastest first) and `ranked` (every
    fitting variant, fastest first, at most 500).

    Raises:
        ConfigError: a pinned degree is impossible (more stages than blocks, ...).
        TfparError: no layout fits in memory.
    """
    if request.pipeline_stages > prof.blocks:
        raise ConfigError("pipeline_stages", request.pipeline_stages,
                          f"{request.model} can be cut into at most {prof.blocks} stages")
    if prof.max_tensor_parallel % request.tensor_parallel:
        raise ConfigError("tensor_parallel", request.tensor_parallel,
                          f"must divide {prof.max_tensor_parallel} ({request.model}'s "
                          "heads or width that the tensor-parallel presets split)")
    batch = request.global_batch_size
    interleave = (1, 2, 4) if request.schedule == "interleaved" else (1,)
    rows = []
    for c in cost.candidates(prof, hw, batch, schedule=request.schedule,
                             recompute={"auto": (False, True), "on": (True,), "off": (False,)}[
                                 request.recompute],
                             zero=request.zero, virtual=interleave):
        if not _pinned(c, request):
            continue
        rows.append(_row(prof, hw, c, request))
    # Ties go to what runs today, then to fewer moving parts.
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: (
        round(r["step_seconds"], 12), r["runnable"] is not None, r["recompute"], r["zero"],
        r["microbatches"], r["virtual"], r["schedule"] == "chimera",
        r["allreduce"] == "hierarchical"))
    if not fitting:
        least = min(rows, key=lambda r: r["memory_bytes"]) if rows else None
        need = (f"the smallest ({label(least)}) needs {least['memory_bytes'] / 1e9:.2f} GB "
                "per device" if least else "no layout splits the batch over them")
        raise TfparError(
            f"{request.model} ({prof.params:,} parameters, global batch {batch}) fits on no "
            f"layout of {hw.devices} device(s) with {hw.memory_bytes / 1e9:.2f} GB each: "
            f"{need}; add devices or memory, or lower --global_batch_size")
    best = fitting[0]
    best["why"] = reasons(best, hw)
    best["neighbours"] = neighbours(best, rows, prof, hw, request)
    commands.attach(best, request, hw)
    runnable_best = next((r for r in fitting if r["runnable"] is None), None)
    if runnable_best is not None and runnable_best is not best:
        runnable_best["why"] = reasons(runnable_best, hw)
        commands.attach(runnable_best, request, hw)
    layouts, seen = [], set()
    for r in fitting:
        key = (r["data"], r["tensor"], r["pipeline"])
        if key not in seen:
            seen.add(key)
            layouts.append(r)
    return {"model": request.model, "params": prof.params, "global_batch_size": batch,
            "hardware": dataclasses.asdict(hw),
            "profile": {k: v for k, v in dataclasses.asdict(prof).items()
                        if k != "matrix_shapes"},
            "recommended": best, "runnable": runnable_best, "layouts": layouts,
            "ranked": fitting[:500], "candidates": len(rows)}


def _pinned(c, request):
    return ((not request.data_parallel or c.data == request.data_parallel)
            and (request.tensor_parallel == 1 or c.tensor == request.tensor_parallel)
            and (request.pipeline_stages == 1 or c.pipeline == request.pipeline_stages)
            and (request.compression == "none" or c.compression in ("none",
                                                                    request.compression)))


def _row(prof, hw, c, request):
    seconds, parts = cost.step_seconds(prof, hw, c, request.global_batch_size)
    memory = cost.memory_bytes(prof, c, request.global_batch_size, request.optimizer)
    return {**dataclasses.asdict(c), "step_seconds": seconds, "parts": parts,
            "padding": cost.padding_fraction(request.global_batch_size, c),
            "memory_bytes": memory, "fits": memory <= hw.memory_bytes,
            "runnable": commands.runnable(c, hw, request)}


def reasons(best, hw):
    """Why `best` was chosen: it fits (how much), where its step goes."""
    parts, total = best["parts"], best["step_seconds"]
    shares = ", ".join(f"{_PART_NAMES[p]} {parts[p] / total:.0%}" for p in PARTS
                       if parts[p] / total >= 0.005)
    return [f"fits: {best['memory_bytes'] / 1e9:.2f} of {hw.memory_bytes / 1e9:.2f} GB per "
            f"device", f"step {_seconds(total)}: {shares}"]


_PART_NAMES = {"overhead": "fixed costs", "compute": "compute", "bubble": "pipeline bubble",
               "data_parallel": "gradient all-reduce", "tensor_parallel":
               "tensor-parallel all-reduces", "pipeline_p2p": "stage-to-stage sends"}


def neighbours(best, rows, prof, hw, request):
    """One line per layout next to `best` (each degree doubled or halved, the data degree
    taking up the rest; micro-batches doubled or halved; recomputation, compression,
    interleaving, the schedule (1F1B / Chimera) and the all-reduce (flat / hierarchical)
    switched) saying why it lost."""
    by_split = {}
    for r in rows:
        by_split.setdefault((r["tensor"], r["pipeline"]), []).append(r)
    out = []
    t, p = best["tensor"], best["pipeline"]
    for nt, np_ in ((t * 2, p), (t // 2, p), (t, p * 2), (t, p // 2), (t * 2, p // 2),
                    (t // 2, p * 2)):
        if nt < 1 or np_ < 1 or (nt, np_) == (t, p):
            continue
        name = f"tp={nt} pp={np_}"
        options = by_split.get((nt, np_))
        if not options:
            out.append(f"{name}: {_impossible(nt, np_, prof, hw, request)}")
            continue
        out.append(_versus(name, options, best, hw))
    same = [r for r in rows if (r["tensor"], r["pipeline"]) == (t, p)]
    variants = (("microbatches", best["microbatches"] * 2, f"mb={best['microbatches'] * 2}"),
                ("microbatches", best["microbatches"] // 2, f"mb={best['microbatches'] // 2}"),
                ("recompute", not best["recompute"],
                 "recompute" if not best["recompute"] else "no recompute"),
                ("compression", "none", "compression=none"),
                ("virtual", 1, "virtual=1"), ("virtual", best["virtual"] * 2,
                                                f"virtual={best['virtual'] * 2}"),
                ("schedule", _other("schedule", best), f"schedule={_other('schedule', best)}"),
                ("allreduce", _other("allreduce", best),
                 f"allreduce={_other('allreduce', best)}"))
    for key, value, name in variants:
        if value == best[key] or not value:
            continue
        keep = {k: best[k] for k in ("microbatches", "recompute", "compression", "virtual",
                                     "zero", "schedule", "allreduce") if k != key}
        options = [r for r in same if r[key] == value and all(
            r[k] == v for k, v in keep.items())]
        if options:
            out.append(_versus(name, options, best, hw))
    return out


def _other(key, row):
    """The alternative to `row`'s schedule (1F1B / Chimera) or all-reduce (flat /
    hierarchical)."""
    pairs = {"schedule": ("1f1b", "chimera"), "allreduce": ("flat", "hierarchical")}[key]
    return pairs[1] if row[key] == pairs[0] else pairs[0]


def _impossible(t, p, prof, hw, request):
    if t * p > hw.devices or hw.devices % (t * p):
        return f"tp x pp = {t * p} does not divide the {hw.devices} devices"
    if prof.max_tensor_parallel % t:
        return f"tp={t} does not divide {prof.max_tensor_parallel} (heads / width it splits)"
    if p > prof.blocks:
        return f"pp={p}: the model cuts into at most {prof.blocks} stages"
    data = hw.devices // (t * p)
    if data > request.global_batch_size:
        return (f"dp={data} is more replicas than the global batch's "
                f"{request.global_batch_size} examples")
    return "excluded by a pinned setting"


def _versus(name, options, best, hw):
    fitting = [r for r in options if r["fits"]]
    if not fitting:
        least = min(options, key=lambda r: r["memory_bytes"])
        return (f"{name} does not fit: {least['memory_bytes'] / 1e9:.1f} GB > "
                f"{hw.memory_bytes / 1e9:.1f} GB ({label(least)})")
    r = min(fitting, key=lambda r: r["step_seconds"])
    slower = r["step_seconds"] / best["step_seconds"] - 1
    if abs(slower) < 5e-4:
        return f"{name}: the same predicted step ({label(r)}); the simpler layout is kept"
    part = max(PARTS, key=lambda k: r["parts"][k] - best["parts"][k])
    why = (f"{_PART_NAMES[part]} {_seconds(r['parts'][part])} vs "
           f"{_seconds(best['parts'][part])}")
    if part == "tensor_parallel" and cost.crosses_machines(hw, r["tensor"], 1):
        why += f" (tp={r['tensor']} crosses the machine boundary)"
    if part == "bubble":
        why += (f" ({cost.bubble_fraction(r['pipeline'], r['microbatches'], r['virtual']):.0%}"
                " idle)")
    return f"{name}: {slower:+.1%} slower ({label(r)}): {why}"


def _seconds(s):
    return f"{s:.3g} s" if s >= 1 else f"{1000 * s:.3g} ms"


def label(row):
    text = (f"dp={row['data']} tp={row['tensor']} pp={row['pipeline']} "
            f"mb={row['microbatches']}")
    if row.get("virtual", 1) > 1:
        text += f" v={row['virtual']}"
    if row.get("schedule") == "chimera":
        text += " chimera"
    text += f" {row['compression']}"
    if row.get("allreduce") == "hierarchical":
        text += " hierarchical"
    if row.get("recompute"):
        text += " recompute"
    if row.get("zero"):
        text += f" zero{row['zero']}"
    if row.get("padding", 0) > 0:
        text += f" padding {row['padding']:.0%}"
    return text


def table(result, top):
    """The plan as text: the best variant of each split, the choice, its reasons, the
    neighbours it beat, and how to run it."""
    hw = result["hardware"]
    lines = [f"{result['model']}: {result['params']:,} parameters, global batch "
             f"{result['global_batch_size']}, {hw['devices']} device(s)",
             f"{'layout (best variant per dp x tp x pp)':<46}{'step':>10}{'memory GB':>11}"
             f"{'comm %':>8}{'bubble %':>9}  runs in tfpar.train"]
    for row in result["layouts"][:top]:
        p, total = row["parts"], row["step_seconds"]
        comm = (p["data_parallel"] + p["tensor_parallel"] + p["pipeline_p2p"]) / total
        lines.append(f"{label(row):<46}{_seconds(total):>10}"
                     f"{row['memory_bytes'] / 1e9:>11.2f}{comm:>8.0%}{p['bubble'] / total:>9.0%}"
                     f"  {'yes' if row['runnable'] is None else 'no'}")
    best = result["recommended"]
    lines += ["", "recommended: " + label(best)] + ["  " + w for w in best["why"]]
    lines += ["  rejected neighbours:"] + ["    " + n for n in best["neighbours"]]
    for title, row in (("recommended", best), ("runnable today", result["runnable"])):
        if row is None:
            lines.append("  no layout that tfpar.train runs today fits")
            continue
        if row is not best:
            lines += ["", f"runnable today: {label(row)} "
                      f"({row['step_seconds'] / best['step_seconds'] - 1:+.0%})"]
            lines += ["  " + w for w in row["why"]]
        if row["runnable"] is not None:
            lines.append(f"  not runnable in tfpar.train yet: {row['runnable']}")
        elif row["command"]:
            lines.append("  run: " + row["command"])
        elif result["model"] in profile.BUILTIN:
            lines.append("  tfpar.train builds this model only at its task's shape "
                         "(see the Python calls)")
        if row["python"]:
            lines += ["  from Python:"] + ["    " + c for c in row["python"]]
        if row is best and result["runnable"] is best:
            break
    return "\n".join(lines)
