"""Stage 0's activation stash measured from its own allocator: GPipe, 1F1B and ZB-H1 as M grows.

    python tools/bench_pipeline_memory.py --microbatches=1,2,4,8,16 --json=runs/pipe_mem.json

Logical CPU devices in one process share one allocator, so a stage's memory cannot be read
there. Here the pipeline runs across two processes (`tfpar.pipeline.remote`): this process
holds stage 0 on its own CPU:0 (its allocator is BFC, `TF_CPU_ALLOCATOR_USE_BFC=true`, so
it keeps a peak) and drives the step; a worker process serves stage 1. The micro-batch
size is fixed (`--microbatch_size`), so the global batch is M times it: a schedule that
stashes every micro-batch (GPipe) then needs memory growing with M, one that stashes at
most K (1F1B, ZB-H1) does not.

Per schedule and M, after two warm-up steps: a step's peak = the allocator's peak during
that step minus what was allocated just before it (variables, optimizer slots, the input
batch), i.e. what the step itself needed on top: stashed activations, gradients,
temporaries. `peak` is the median over `--measured_steps` steps (each step's in
`step_peaks_mb`): one step's peak moves with how the two processes happen to be scheduled
(tensors sent to a descheduled receiver wait in its memory), the median much less.
One micro-batch's activations (`per_microbatch_mb`) is the slope of GPipe's peak over M
(least squares; GPipe stashes all M by construction), and `stash` = (peak - intercept) /
slope: the micro-batches stage 0 held at its peak, measured from memory. The schedule
simulator's peak (`stash_sim`) is printed next to it.

With --live_at_peak=N the last measured step runs under the TensorFlow profiler (which records
every allocation and free of the BFC allocator with the op that made it); the tool replays
them and prints what was alive at the peak, grouped by op name.

Output: a table, and with --json {"benchmark": "pipeline_memory", "rows": [...], "fit": ...}.
"""

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from absl import app, flags

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow starts: a peak to read
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FLAGS = flags.FLAGS
flags.DEFINE_list("microbatches", ["1", "2", "4", "8", "16"], "micro-batch counts M")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "zb_h1"], "schedules (gpipe first: its "
                  "slope sizes one micro-batch)")
flags.DEFINE_integer("microbatch_size", 128, "rows per micro-batch (the batch is M times it)")
flags.DEFINE_integer("width", 1024, "width of each Dense block")
flags.DEFINE_integer("layers", 8, "Dense blocks (half on each stage)")
flags.DEFINE_string("json", "", "write the results here")
flags.DEFINE_bool("one_op_at_a_time", False, "each stage runs its ops one at a time in the "
                  "schedule's order (PipelineExecutor's one_op_at_a_time): the stash then "
                  "depends on the schedule alone, not on how fast the other process runs")
flags.DEFINE_integer("measured_steps", 3, "steps measured per schedule and M; `peak` is "
                     "the median of their peaks", lower_bound=1)
flags.DEFINE_integer("live_at_peak", 0, "also profile the last measured step and print, per run, "
                     "the N largest groups of tensors alive at stage 0's peak (by the op "
                     "that made them, digits folded)")

K = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_worker(address):
    """The process serving stage 1; returns it once its server is up."""
    proc = subprocess.Popen([sys.executable, "-m", "tfpar.pipeline.remote", "--workers",
                             address, "--task", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    # Same process group as this tool: a caller that kills the group on a timeout ends both.
    deadline = time.monotonic() + 120
    line = ""
    while "serving" not in line:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the stage-1 worker did not start: {line}")
        line = proc.stdout.readline()
    return proc


def _fit(points):
    """Least-squares line through (x, y) points: (slope, intercept)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx


def _live_at_peak(logdir, top):
    """Replays the profiler's allocation events of stage 0's CPU allocator; returns the `top`
    groups of tensors alive at the traced peak as [op name with digits as '#', MB, count]."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    path = max(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True),
               key=os.path.getmtime)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                kind = plane.event_metadata[ev.metadata_id].name
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for st in ev.stats:
                    stats[stat_names.get(st.metadata_id)] = (
                        st.str_value or (plane.stat_metadata[st.ref_value].name
                                         if st.ref_value else None)
                        or st.int64_value or st.uint64_value)
                events.append((line.timestamp_ns * 1000 + ev.offset_ps, kind, stats))
    live, now, peak = {}, 0, (0, {})
    for _, kind, stats in sorted(events, key=lambda e: e[0]):
        addr = stats.get("addr")
        if kind == "MemoryAllocation":
            live[addr] = (stats.get("allocation_bytes") or 0, str(stats.get("tf_op")))
            now += live[addr][0]
            if now > peak[0]:
                peak = (now, dict(live))
        elif addr in live:
            now -= live.pop(addr)[0]
    groups = {}
    for size, op in peak[1].values():
        key = re.sub(r"\d+", "#", op)
        mb, count = groups.get(key, (0.0, 0))
        groups[key] = (mb + size / 2**20, count + 1)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    for key, (mb, count) in ranked:
        print(f"      {mb:7.1f} MB in {count:3} tensors from {key}", file=sys.stderr)
    return [[key, mb, count] for key, (mb, count) in ranked]


def measure(address, schedules, Ms):
    """Stage 0's step peak (MB above the resting allocation) per (schedule, M)."""
    from tfpar.pipeline import remote
    (remote_device,) = remote.connect([address])
    import keras
    import numpy as np
    import tensorflow as tf
    from tfpar.pipeline.executor import PipelineExecutor
    from tfpar.pipeline.partition import partition
    from tfpar.pipeline.schedule import make_schedule, simulate
    local = "/job:localhost/replica:0/task:0/device:CPU:0"
    devices = [local, remote_device]
    rows = []
    for name in schedules:
        for M in Ms:
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [keras.Input((FLAGS.width,))]
                + [keras.layers.Dense(FLAGS.width, activation="relu")
                   for _ in range(FLAGS.layers)], name="blocks")
            stages = partition(model, K, devices=devices)
            sched = make_schedule(name, K, M)
            ex = PipelineExecutor(stages, devices, sched, keras.losses.MeanSquaredError(),
                                  one_op_at_a_time=FLAGS.one_op_at_a_time)
            ex.build_optimizers(keras.optimizers.SGD(1e-3))
            step = tf.function(ex.train_step, jit_compile=False)
            rng = np.random.default_rng(0)
            n = M * FLAGS.microbatch_size
            with tf.device(local):
                x = tf.constant(rng.normal(size=(n, FLAGS.width)).astype("float32"))
            with tf.device(remote_device):
                y = tf.constant(rng.normal(size=(n, FLAGS.width)).astype("float32"))
            for _ in range(2):  # trace, warm up
                step(x, y)[0].numpy()
            step_peaks = []
            for i in range(FLAGS.measured_steps):
                resting = tf.config.experimental.get_memory_info("CPU:0")["current"]
                tf.config.experimental.reset_memory_stats("CPU:0")
                profile = FLAGS.live_at_peak and i == FLAGS.measured_steps - 1
                logdir = tempfile.mkdtemp(prefix="tfpar_mem_") if profile else None
                if logdir:
                    tf.profiler.experimental.start(logdir)
                step(x, y)[0].numpy()
                if logdir:
                    tf.profiler.experimental.stop()
                peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
                step_peaks.append((peak - resting) / 2**20)
            rows.append({"schedule": name, "microbatches": M, "batch": n,
                         "peak_mb": float(np.median(step_peaks)),
                         "step_peaks_mb": step_peaks,
                         "stash_sim": simulate(sched, K, M).peak_stash[0]})
            print(f"  {name} M={M}: {rows[-1]['peak_mb']:.1f} MB", file=sys.stderr, flush=True)
            if logdir:
                rows[-1]["live_at_peak"] = _live_at_peak(logdir, FLAGS.live_at_peak)
                shutil.rmtree(logdir, ignore_errors=True)
    return rows


def main(argv):
    del argv
    Ms = sorted(set(map(int, FLAGS.microbatches)))
    address = f"localhost:{_free_port()}"
    worker = _start_worker(address)
    try:
        rows = measure(address, FLAGS.schedules, Ms)
    finally:
        worker.kill()  # by its own PID: the process this tool started
        worker.wait()
    gpipe = [(r["microbatches"], r["peak_mb"]) for r in rows if r["schedule"] == "gpipe"]
    slope, intercept = _fit(gpipe) if len(gpipe) > 1 else (None, None)
    for r in rows:
        r["stash"] = (r["peak_mb"] - intercept) / slope if slope else None
    print(f"stage 0 of {FLAGS.layers} x Dense({FLAGS.width}) over K={K} processes, "
          f"{FLAGS.microbatch_size} rows per micro-batch (batch = M x {FLAGS.microbatch_size});"
          f" stage 0's allocator peak during one step above its resting allocation")
    names = [n for n in FLAGS.schedules if any(r["schedule"] == n for r in rows)]
    print(f"{'M':>3}" + "".join(f"{n + ' MB':>12}{'stash':>7}{'sim':>5}" for n in names))
    by = {(r["schedule"], r["microbatches"]): r for r in rows}
    for M in Ms:
        cells = ""
        for n in names:
            r = by.get((n, M))
            stash = f"{r['stash']:.1f}" if r and r["stash"] is not None else "-"
            cells += (f"{r['peak_mb']:>12.1f}{stash:>7}{r['stash_sim']:>5}" if r
                      else f"{'-':>12}{'-':>7}{'-':>5}")
        print(f"{M:>3}{cells}")
    if slope:
        print(f"one micro-batch's activations on stage 0 (GPipe's slope): {slope:.2f} MB; "
              f"intercept {intercept:.1f} MB; stash = (peak - intercept) / slope, in "
              f"micro-batches; sim = the schedule simulator's peak for stage 0")
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump({"benchmark": "pipeline_memory", "stages": K, "width": FLAGS.width,
                       "layers": FLAGS.layers, "microbatch_size": FLAGS.microbatch_size,
                       "fit": {"per_microbatch_mb": slope, "intercept_mb": intercept},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here or in any child (they inherit it).
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    app.run(main)
