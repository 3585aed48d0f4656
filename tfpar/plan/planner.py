"""The planner: rank every layout the cost model allows and explain the winner."""

import dataclasses
import time

from absl import logging

from tfpar.errors import ConfigError, TfparError
from tfpar.plan import calibration, cost, profile


def hardware_from(devices, memory_gb, tflops, intra_gbps, inter_gbps, devices_per_machine=0):
    """A `cost.Hardware` from the units people quote (GB, TFLOP/s, Gbit/s).

    Raises:
        ConfigError: no devices given.
    """
    if devices < 1:
        raise ConfigError("devices", devices, "give the number of devices to plan for (>= 1)")
    return cost.Hardware(devices=devices, memory_bytes=memory_gb * 1e9, flops=tflops * 1e12,
                         intra_bandwidth=intra_gbps * 1e9 / 8,
                         inter_bandwidth=inter_gbps * 1e9 / 8,
                         devices_per_machine=devices_per_machine)


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
    prof = profile.profile_builtin(config.model, config.model_width, config.model_depth)
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
    memory = psutil.virtual_memory().total / devices
    return cost.Hardware(devices=devices, memory_bytes=memory, flops=flops,
                         intra_bandwidth=bandwidth, inter_bandwidth=bandwidth,
                         latency=latency, shared_cores=True), flops


def plan(config, hw, simulated_cpu=False):
    """Ranks every layout of `config.model` on `hw`; returns a JSON-able dict.

    Pins from `config` are respected: `tensor_parallel`/`pipeline_stages` > 1 and
    `compression` other than none restrict the search to that value.

    Raises:
        ConfigError: a pinned degree is impossible (more stages than blocks, ...).
        TfparError: no layout fits in memory.
    """
    prof = profile.profile_builtin(config.model, config.model_width, config.model_depth)
    if config.pipeline_stages > prof.blocks:
        raise ConfigError("pipeline_stages", config.pipeline_stages,
                          f"{config.model} can be cut into at most {prof.blocks} stages")
    if config.tensor_parallel > prof.max_tensor_parallel:
        raise ConfigError("tensor_parallel", config.tensor_parallel,
                          f"{config.model}'s presets split by at most {prof.max_tensor_parallel}")
    batch = config.global_batch_size
    rows = []
    for c in cost.candidates(prof, hw, batch):
        if config.tensor_parallel > 1 and c.tensor != config.tensor_parallel:
            continue
        if config.pipeline_stages > 1 and c.pipeline != config.pipeline_stages:
            continue
        if config.compression != "none" and c.compression not in ("none", config.compression):
            continue
        seconds, parts = cost.step_seconds(prof, hw, c, batch)
        memory = cost.memory_bytes(prof, c, batch, config.optimizer, config.schedule)
        rows.append({**dataclasses.asdict(c), "step_seconds": seconds, "parts": parts,
                     "memory_bytes": memory, "fits": memory <= hw.memory_bytes})
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: r["step_seconds"])
    if not fitting:
        least = min(rows, key=lambda r: r["memory_bytes"]) if rows else None
        need = f"{least['memory_bytes'] / 1e9:.2f} GB" if least else "?"
        raise TfparError(
            f"{config.model} ({prof.params:,} parameters, global batch {batch}) fits on no "
            f"layout of {hw.devices} device(s) with {hw.memory_bytes / 1e9:.2f} GB each: the "
            f"smallest needs {need} per device; add devices or memory, or lower "
            f"--global_batch_size")
    best = fitting[0]
    best["command"] = command(config, best, hw, simulated_cpu)
    best["why"] = reasons(best, fitting, hw)
    return {"model": config.model, "params": prof.params, "global_batch_size": batch,
            "hardware": dataclasses.asdict(hw), "recommended": best, "ranked": fitting}


def command(config, row, hw, simulated_cpu):
    parts = ["python -m tfpar.train", f"--model={config.model}",
             f"--global_batch_size={config.global_batch_size}"]
    if config.model_width:
        parts.append(f"--model_width={config.model_width}")
    if config.model_depth:
        parts.append(f"--model_depth={config.model_depth}")
    if simulated_cpu:
        parts.append(f"--cpu_devices={hw.devices}")
    if row["tensor"] > 1:
        parts += [f"--tensor_parallel={row['tensor']}", f"--data_parallel={row['data']}"]
    if row["pipeline"] > 1:
        parts += [f"--pipeline_stages={row['pipeline']}", f"--microbatches={row['microbatches']}",
                  f"--schedule={config.schedule}"]
    if row["compression"] != "none":
        parts.append(f"--compression={row['compression']}")
    return " ".join(parts)


def reasons(best, ranked, hw):
    parts = best["parts"]
    total = best["step_seconds"]
    why = [f"fits: {best['memory_bytes'] / 1e9:.2f} of {hw.memory_bytes / 1e9:.2f} GB per device",
           f"fixed step costs {parts['overhead'] / total:.0%} of the step, compute "
           f"{parts['compute'] / total:.0%}, data-parallel all-reduce "
           f"{parts['data_parallel'] / total:.0%}, tensor-parallel "
           f"{parts['tensor_parallel'] / total:.0%}, pipeline bubble "
           f"{parts['bubble'] / total:.0%}"]
    if len(ranked) > 1:
        runner = ranked[1]
        why.append(f"{runner['step_seconds'] / total - 1:+.0%} slower: the next best, "
                   f"{label(runner)}")
    return why


def label(row):
    return (f"dp={row['data']} tp={row['tensor']} pp={row['pipeline']} "
            f"mb={row['microbatches']} {row['compression']}")


def table(result, top):
    lines = [f"{result['model']}: {result['params']:,} parameters, global batch "
             f"{result['global_batch_size']}, {result['hardware']['devices']} device(s)",
             f"{'layout':<42}{'step ms':>10}{'memory GB':>11}{'comm %':>8}{'bubble %':>9}"]
    for row in result["ranked"][:top]:
        p, total = row["parts"], row["step_seconds"]
        comm = (p["data_parallel"] + p["tensor_parallel"] + p["pipeline_p2p"]) / total
        lines.append(f"{label(row):<42}{1000 * total:>10.2f}{row['memory_bytes'] / 1e9:>11.3f}"
                     f"{comm:>8.0%}{p['bubble'] / total:>9.0%}")
    best = result["recommended"]
    lines += ["", "recommended: " + label(best)] + ["  " + w for w in best["why"]]
    lines += ["  run: " + best["command"]]
    return "\n".join(lines)
