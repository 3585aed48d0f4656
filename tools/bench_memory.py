"""Memory benchmark: under a per-device memory cap, the largest transformer that trains.

    python tools/bench_memory.py                        # 4 devices, 96 MB each
    python tools/bench_memory.py --quick                # a smoke run, a few minutes

For each configuration — plain data parallelism, ZeRO-1/2/3, tensor parallelism, plain
and ZeRO-1/2 with the optimizer state offloaded to the host (`--offload=optimizer`), each
without and with `--recompute=blocks` — it searches a ladder of transformers (width ×
depth, ordered by parameters) for the largest that trains `--steps` steps under the cap,
and reports it with its step time (median) and its measured peak per device. A
configuration `tfpar.compat` refuses is printed as "refused: <reason>".

`--overhead` instead times plain, ZeRO-1, ZeRO-2, ZeRO-3 (with its prefetch, the default,
and without: `zero3-noprefetch`, `--nozero_prefetch`; the last block and the layers after
it kept whole: `zero3-keeplast`, `--zero_keep_last_layers=-1`; without its recomputation:
`zero3-keep`, `--nozero_reshard_after_forward`) and the offloaded plain, ZeRO-1
and ZeRO-2 on one size, uncapped, alternating in each of `--rounds` rounds (side by side in
one run), with each run's allocator peak per device and the bytes an offloaded step copies
device -> host and host -> device. Step times of
the ladder with `--quick` (2 steps) include the first step's tracing: use `--overhead`
for step times.

How the cap is enforced on CPU: `tf.config.set_logical_device_configuration(...,
memory_limit=...)` is refused for CPUs by TensorFlow 2.21 ("Setting memory limit on CPU
virtual devices is currently not supported"; `--probe_limit` checks), and logical CPUs
share one allocator. So each configuration runs in its own child process (`python -m
tfpar.train`) with the process's CPU allocator capped at devices x cap
(`TF_CPU_BFC_MEM_LIMIT_IN_MB`, BFC on): a run that needs more fails with tfpar's one-line
out-of-memory error. On top of that, the measured allocator peak per device (process
peak / devices) must be within the cap. This is a cap on the devices' sum, not on each
device: it equals a per-device cap only while the devices' peaks coincide, which they do
here as every configuration is SPMD (each device runs the same program on pieces of the
same size, in step through the collectives), but a device whose peak came earlier than
the others' could borrow from their share unnoticed.

Offload on this CPU-only machine (`tfpar.offload`): the host's slots are NumPy arrays of
the child process, outside TensorFlow's allocator, so they do not count against the cap;
everything TensorFlow allocates (weights, gradients, activations, the gradient handed to
the host and the step handed back) does. The cap thus separates device memory from host
memory as a GPU's would; what it cannot show is a real link's copy time (both sides are
the same RAM here): a step's cost is its time here plus its bytes copied over your link.

Parameters (`params`, `x plain`) are the ladder's 12 x width^2 x depth (the blocks; the
small embeddings and head are left out alike for every configuration).

Output: a table, and JSON under runs/ (or --json): {"benchmark": "memory", "cap_mb",
"devices", "rows": [{"name", "flags", "refused" | "largest": {"width", "depth", "params",
"step_ms", "peak_mb_per_device"}, "tried": [...]}]}. An offloaded probe adds
"host_state_mb", "copied_to_host_mb_per_step", "copied_to_device_mb_per_step" and every
probe "peak_rss_mb" (the whole process: devices' and host's memory).
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

import train_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 4, "logical CPU devices (replicas)")
flags.DEFINE_integer("cap_mb", 96, "memory cap per device, MB")
flags.DEFINE_integer("batch", 64, "global batch size")
flags.DEFINE_integer("steps", 3, "training steps per probe")
flags.DEFINE_list("widths", ["64", "128", "192", "256", "384", "512", "768", "1024"],
                  "transformer widths of the ladder (multiples of 4 x tensor_parallel)")
flags.DEFINE_list("depths", ["2", "4", "8"], "transformer depths of the ladder")
flags.DEFINE_list("only", [], "run only these configurations (names of the table)")
flags.DEFINE_string("optimizer", "adam", "optimizer (its state is what ZeRO-1 splits)")
flags.DEFINE_bool("quick", False, "smoke run: 2 devices, a short ladder, 2 steps")
flags.DEFINE_bool("probe_limit", False, "only check whether a logical CPU's memory_limit "
                  "is honoured, and exit")
flags.DEFINE_string("json", "", "write the results here (default runs/bench_memory_<time>.json)")
flags.DEFINE_integer("timeout", 600, "seconds per child run")
flags.DEFINE_bool("overhead", False, "instead of the ladder: step time of plain and ZeRO-1/"
                  "2/3 on one size (--overhead_width x --overhead_depth), uncapped, the "
                  "configurations alternating in --rounds rounds")
flags.DEFINE_integer("overhead_width", 256, "transformer width of --overhead")
flags.DEFINE_integer("overhead_depth", 4, "transformer depth of --overhead")
flags.DEFINE_integer("rounds", 3, "rounds of --overhead")

CONFIGS = [  # name, trainer flags
    ("plain", []),
    ("zero1", ["--zero_stage=1"]),
    ("zero2", ["--zero_stage=2"]),
    ("zero3", ["--zero_stage=3"]),
    ("tensor", ["--tensor_parallel={tp}", "--data_parallel=1"]),
    ("plain+offload", ["--offload=optimizer"]),
    ("zero1+offload", ["--zero_stage=1", "--offload=optimizer"]),
    ("zero2+offload", ["--zero_stage=2", "--offload=optimizer"]),
]
# `--overhead`'s configurations, timed side by side.
OVERHEAD_CONFIGS = [("plain", ["--strategy=mirrored"]),
                    ("zero1", ["--strategy=mirrored", "--zero_stage=1"]),
                    ("zero2", ["--strategy=mirrored", "--zero_stage=2"]),
                    ("zero3-noprefetch", ["--zero_stage=3", "--nozero_prefetch"]),
                    ("zero3-keeplast", ["--zero_stage=3", "--zero_keep_last_layers=-1"]),
                    ("zero3", ["--zero_stage=3"]),
                    ("zero3-keep", ["--zero_stage=3", "--nozero_reshard_after_forward"]),
                    ("plain+offload", ["--strategy=mirrored", "--offload=optimizer"]),
                    ("zero1+offload", ["--strategy=mirrored", "--zero_stage=1",
                                       "--offload=optimizer"]),
                    ("zero2+offload", ["--strategy=mirrored", "--zero_stage=2",
                                       "--offload=optimizer"])]


def refusal(flag_list, devices):
    """`tfpar.compat`'s reason for refusing these flags, or None."""
    from tfpar import ParallelConfig
    from tfpar.errors import ConfigError

    settings = {"model": "transformer", "cpu_devices": devices}
    for flag in flag_list:
        key, value = flag[2:].split("=")
        settings[key] = int(value) if value.isdigit() else value
    try:
        ParallelConfig(**settings)
    except ConfigError as err:
        return str(err)
    return None


def ladder():
    sizes = []
    for width in (int(w) for w in FLAGS.widths):
        for depth in (int(d) for d in FLAGS.depths):
            params = 12 * width * width * depth  # the blocks; embeddings are tiny here
            sizes.append((params, width, depth))
    return sorted(sizes)


def probe(flag_list, width, depth, capped=True):
    """Trains one size in a child; returns a dict with `fits` and what was measured."""
    devices = FLAGS.devices
    cap = {"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(devices * FLAGS.cap_mb)} if capped else {}
    metrics, error, seconds = train_run.train(
        ["--model=transformer", f"--model_width={width}", f"--model_depth={depth}",
         f"--cpu_devices={devices}", f"--global_batch_size={FLAGS.batch}",
         f"--steps={FLAGS.steps}", f"--steps_per_epoch={FLAGS.steps}",
         f"--optimizer={FLAGS.optimizer}", *flag_list], FLAGS.timeout, cap)
    out = {"width": width, "depth": depth, "seconds": round(seconds, 1)}
    if error is not None:
        out.update(fits=False, error=error, oom="out of memory" in error)
        return out
    memory = metrics["memory"]
    peaks = memory.get("peak_bytes_per_device") or [0]
    peak = max(peaks) / (len(peaks) if memory.get("peak_bytes_scope") == "process" else 1)
    out.update(params=sum(metrics["memory"]["params_per_device"][:1]) or None,
               step_ms=metrics["step_time_ms"]["median"],
               peak_mb_per_device=round(peak / 2 ** 20, 2),
               param_mb_per_device=round(max(memory["param_bytes_per_device"]) / 2 ** 20, 2),
               optimizer_mb_per_device=round(
                   max(memory["optimizer_state_bytes_per_device"]) / 2 ** 20, 2),
               peak_rss_mb=memory.get("peak_rss_mb"))
    if "offload" in metrics:
        host = metrics["offload"]
        out.update(host_state_mb=round(host["host_state_bytes"] / 2 ** 20, 2),
                   copied_to_host_mb_per_step=round(host["bytes_to_host_per_step"] / 2 ** 20, 2),
                   copied_to_device_mb_per_step=round(
                       host["bytes_to_device_per_step"] / 2 ** 20, 2))
    out["fits"] = peak <= FLAGS.cap_mb * 2 ** 20
    if not out["fits"]:
        out["error"] = (f"measured peak {out['peak_mb_per_device']} MB per device over the "
                        f"{FLAGS.cap_mb} MB cap")
    return out


def largest(flag_list):
    """Binary search of the ladder for the largest size that fits (fitting taken as
    monotone in the parameters)."""
    sizes = ladder()
    tried, lo, hi, best = [], 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        params, width, depth = sizes[mid]
        result = probe(flag_list, width, depth)
        result["ladder_params"] = params
        tried.append(result)
        print(f"    {width}x{depth}: {'fits' if result['fits'] else result.get('error')}",
              flush=True)
        if result["fits"]:
            best, lo = result, mid + 1
        else:
            hi = mid - 1
    return best, tried


def probe_limit():
    """Whether a logical CPU honours memory_limit: allocate 100 MB on one limited to 64."""
    code = ("import tensorflow as tf\n"
            "cpu = tf.config.list_physical_devices('CPU')[0]\n"
            "tf.config.set_logical_device_configuration(cpu, "
            "[tf.config.LogicalDeviceConfiguration(memory_limit=64)] * 2)\n"
            "with tf.device('CPU:0'):\n"
            "    a = tf.ones([100 * 2**20 // 4]); b = a + 1\n"
            "print('allocated', float(tf.reduce_sum(b)) > 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
                                   TF_CPP_MIN_LOG_LEVEL="2"), timeout=120)
    if "allocated True" in proc.stdout:
        verdict = "100 MB allocated on it: not honoured"
    elif "ResourceExhausted" in proc.stderr or "OOM" in proc.stderr:
        verdict = "100 MB refused: honoured"
    else:
        verdict = "refused by TensorFlow: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    print(f"logical CPU with memory_limit=64 MB: {verdict}")


def overhead():
    """Step time (median of each run's steps) of `OVERHEAD_CONFIGS` (or those `--only`
    names) on one size, uncapped; they alternate within each round so that a slower spell
    of the machine hits all of them. Returns the rows for the JSON."""
    configs = [c for c in OVERHEAD_CONFIGS if not FLAGS.only or c[0] in FLAGS.only]
    width, depth = FLAGS.overhead_width, FLAGS.overhead_depth
    print(f"step time: transformer width {width} depth {depth}, {FLAGS.devices} logical "
          f"CPUs, global batch {FLAGS.batch}, {FLAGS.optimizer}, {FLAGS.steps} steps per "
          f"run, {FLAGS.rounds} rounds", flush=True)
    times = {name: [] for name, _ in configs}
    memory = {}
    for round_ in range(FLAGS.rounds):
        for name, flag_list in configs:
            result = probe(flag_list, width, depth, capped=False)
            if "step_ms" not in result:
                raise SystemExit(f"{name}: {result.get('error')}")
            times[name].append(result["step_ms"])
            memory[name] = {k: result[k] for k in (
                "param_mb_per_device", "optimizer_mb_per_device", "peak_mb_per_device",
                "host_state_mb",
                "copied_to_host_mb_per_step", "copied_to_device_mb_per_step") if k in result}
            print(f"  round {round_ + 1} {name}: {result['step_ms']:.1f} ms", flush=True)
    base = statistics.median(times[configs[0][0]])
    print(f"\n{'configuration':<17}{'median ms':>10}{'vs ' + configs[0][0]:>10}"
          f"  {'params MB/dev':>15}{'opt. state MB/dev':>19}"
          f"{'peak MB/dev':>13}{'host MB':>9}{'copied MB/step':>16}  rounds (ms)")
    rows = []
    for name, _ in configs:
        med = statistics.median(times[name])
        rounds = " ".join(f"{t:.1f}" for t in times[name])
        mem = memory[name]
        copied = (f"{mem['copied_to_host_mb_per_step']:.2f}+"
                  f"{mem['copied_to_device_mb_per_step']:.2f}"
                  if "host_state_mb" in mem else "-")
        print(f"{name:<17}{med:>10.1f}{(med / base - 1) * 100:>+9.1f}%"
              f"  {mem['param_mb_per_device']:>15.2f}{mem['optimizer_mb_per_device']:>19.2f}"
              f"{mem['peak_mb_per_device']:>13.2f}"
              f"{mem.get('host_state_mb', 0):>9.2f}{copied:>16}  {rounds}")
        rows.append({"name": name, "step_ms_rounds": times[name], "step_ms_median": med,
                     "overhead_vs_plain": med / base - 1, **memory[name]})
    return rows


def main(argv):
    del argv
    if FLAGS.probe_limit:
        probe_limit()
        return
    if FLAGS.overhead:
        rows = overhead()
        path = FLAGS.json or os.path.join(
            ROOT, "runs", time.strftime("bench_memory_overhead_%Y%m%d_%H%M%S.json"))
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"benchmark": "memory_overhead", "devices": FLAGS.devices,
                       "width": FLAGS.overhead_width, "depth": FLAGS.overhead_depth,
                       "global_batch_size": FLAGS.batch, "optimizer": FLAGS.optimizer,
                       "steps": FLAGS.steps, "rows": rows}, f, indent=1)
        print(f"wrote {path}")
        return
    if FLAGS.quick:
        FLAGS.devices, FLAGS.steps = 2, 2
        FLAGS.widths, FLAGS.depths = ["64", "128", "256", "512"], ["2", "4"]
    tp = FLAGS.devices
    rows = []
    print(f"cap {FLAGS.cap_mb} MB per device x {FLAGS.devices} logical CPUs "
          f"(process CPU allocator capped at {FLAGS.devices * FLAGS.cap_mb} MB), "
          f"global batch {FLAGS.batch}, {FLAGS.optimizer}, {FLAGS.steps} steps per probe",
          flush=True)
    for base, base_flags in CONFIGS:
        for recompute in ("none", "blocks"):
            name = base + ("+recompute" if recompute != "none" else "")
            if FLAGS.only and name not in FLAGS.only:
                continue
            flag_list = [f.format(tp=tp) for f in base_flags]
            if base not in ("tensor", "zero3"):  # those two run on a DTensor mesh
                flag_list.append("--strategy=mirrored")
            if recompute != "none":
                flag_list.append(f"--recompute={recompute}")
            row = {"name": name, "flags": flag_list}
            why = refusal([f for f in flag_list if f != "--strategy=mirrored"], FLAGS.devices)
            if why:
                row["refused"] = why
                print(f"  {name}: refused: {why}", flush=True)
            else:
                print(f"  {name}: {' '.join(flag_list)}", flush=True)
                row["largest"], row["tried"] = largest(flag_list)
            rows.append(row)
    plain = next((r.get("largest") for r in rows if r["name"] == "plain"), None)
    print()
    print(f"{'configuration':<26}{'largest that trains':>22}{'params':>12}{'x plain':>9}"
          f"{'step ms':>9}{'peak MB/dev':>13}{'host MB':>9}{'copied MB/step':>16}")
    for row in rows:
        if "refused" in row:
            print(f"{row['name']:<26}refused: {row['refused']}")
            continue
        best = row["largest"]
        if best is None:
            print(f"{row['name']:<26}{'nothing on the ladder':>22}")
            continue
        params = best["ladder_params"]
        ratio = f"{params / plain['ladder_params']:.2f}" if plain else "-"
        copied = (f"{best['copied_to_host_mb_per_step']:.2f}+"
                  f"{best['copied_to_device_mb_per_step']:.2f}" if "host_state_mb" in best
                  else "-")
        print(f"{row['name']:<26}{'width %d depth %d' % (best['width'], best['depth']):>22}"
              f"{params:>12,}{ratio:>9}{best['step_ms']:>9.1f}"
              f"{best['peak_mb_per_device']:>13.1f}{best.get('host_state_mb', 0):>9.1f}"
              f"{copied:>16}")
    path = FLAGS.json or os.path.join(ROOT, "runs",
                                      time.strftime("bench_memory_%Y%m%d_%H%M%S.json"))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": "memory", "cap_mb": FLAGS.cap_mb, "devices": FLAGS.devices,
                   "global_batch_size": FLAGS.batch, "optimizer": FLAGS.optimizer,
                   "steps": FLAGS.steps, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here or in any child (they inherit it).
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    app.run(main)
