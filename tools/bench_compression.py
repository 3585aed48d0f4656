"""Every gradient aggregator side by side, two workers across a bandwidth-shaped link.

Two worker processes (`MultiWorkerMirroredStrategy`, one CPU replica each) in their own
network namespaces, joined by a veth pair shaped to `--rate` (default 100 Mbit/s each way,
see tools/shaped_link.py), train the same ~6.3 M-parameter MLP (width 1024, depth 7) from
the same seed on the same batches with each aggregator in turn, through `tfpar.train.train`.

    python tools/bench_compression.py            # all aggregators, 150 steps (~25 min)
    python tools/bench_compression.py --quick    # none, fp16, topk, powersgd; 12 steps (<3 min)

Top-k runs with DGC's density warm-up (`--topk_warmup_steps`, default 10: 25 % of the
entries at the first step, decaying exponentially to 1 % at step 10); `topk_nowarmup` is the
same aggregator without it, run side by side to show what the warm-up buys and costs.

Needs root (namespaces, tc) and iproute2. Prints a table; writes `--out` (JSON: the
metrics of every run, in the `tfpar.metrics` shape, plus per-step wall clock, and the
comparison) and `--png` (smoothed loss against wall-clock and against steps).

Measured per run: bytes per step handed to the collectives (the aggregator's count) and
carried by the veth (kernel counters, both directions, steps 3 to the last), steps/s
(1 / median step time after 2 warm-up steps), the communication share of a step
(`tfpar.compression.timing.measure_comm_fraction`, after training) and how much of the
aggregation hides behind the backward pass (its `overlap_fraction`), wall-clock (from the
end of the first step, which holds tracing) until the smoothed loss first reaches the fp32
run's final smoothed loss, and the final loss at fp32's last step (the mean of the last `--smooth` batch
losses: every run sees the same batches, so the means compare like for like). Compressed
runs train `--extra` (25 %) more steps than fp32, so that one a little behind at fp32's
last step can still show when it reaches fp32's final loss.
"""

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

AGGREGATORS = ("none", "fp16", "bf16", "int8", "topk", "topk_nowarmup", "threshold", "auto",
               "powersgd")
QUICK = ("none", "fp16", "topk", "powersgd")
# Runs that only show what one setting does; the goals are not checked on them.
# topk_buckets: one bucket per layer instead of one for the whole model, so the last
# layers' all-gathers could start while backward still computes the first layers' gradients.
# none_keras: fp32 through Keras's one all-reduce (`--bucket_mb=0`), against which `none`
# (across workers: the exact fp32 sums in --bucket_mb buckets, last layers first) is compared.
VARIANTS = {"topk_nowarmup": ("topk", {"topk_warmup_steps": 0}),
            "topk_buckets": ("topk", {"bucket_mb": 4.1}),
            "none_keras": ("none", {"bucket_mb": 0})}
GOALS = {"powersgd": 15.0, "topk": 8.0, "fp16": 1.9}  # steps/s vs fp32
PORT = 23456


# ---- one worker ----------------------------------------------------------------------
def worker(config_json, out_path):
    """Runs inside a namespace: `train(config)` with a wall-clock recorder; the chief writes
    the metrics (the `tfpar.metrics` shape) plus `wall_clock_s` (end of each step, from the
    start of training) to `out_path`."""
    from tfpar import ParallelConfig, cpu_kernels

    config = ParallelConfig(**json.loads(config_json))
    cpu_kernels.select(config.cpu_kernels)  # before TensorFlow starts, as tfpar.train's CLI
    import keras

    from tfpar import data
    from tfpar.compression.timing import measure_comm_fraction
    from tfpar.train import train

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    device = os.environ["TFPAR_BENCH_DEVICES"].split(",")[index]  # this side's veth end
    stats = f"/sys/class/net/{device}/statistics/"

    def veth_bytes():  # both directions of this namespace's veth end: both workers' traffic
        total = 0
        for name in ("tx_bytes", "rx_bytes"):
            with open(stats + name) as f:
                total += int(f.read())
        return total

    class WallClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.start, self.ends, self.veth, self.cpu = None, [], [], []

        def on_train_batch_begin(self, batch, logs=None):
            if self.start is None:
                self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # the step has finished
            self.ends.append(time.perf_counter() - self.start)
            self.cpu.append(time.process_time())  # this worker's CPU (every thread)
            self.veth.append(veth_bytes())

    clock = WallClock()
    result, model = train(config, callbacks=[clock])
    # Communication share of a step: compute-only vs full steps on a scratch aggregator
    # (every worker takes part: the collectives are collective).
    comm_steps = int(os.environ.get("TFPAR_BENCH_COMM_STEPS", "3"))
    if comm_steps:
        strategy = model.distribute_strategy
        share, times = measure_comm_fraction(
            strategy, model,
            data.distributed_dataset(strategy, config, data.make_task(config)),
            steps=comm_steps)
        result.setdefault("comm", {}).update(
            comm_time_fraction=share, overlap_fraction=times.get("overlap_fraction"),
            comm_timing_ms={k: v for k, v in times.items() if k.endswith("_ms")})
    if index == 0:
        import side_resources  # tools/ (this script's directory)
        result["tensorflow_threads"] = side_resources.tensorflow_threads()  # as each worker's
        result["wall_clock_s"] = clock.ends
        result["process_cpu_s"] = clock.cpu  # worker 0's CPU seconds at each step's end
        # After the first two steps (tracing, first collectives' set-up).
        steady = clock.veth[2:] if len(clock.veth) > 3 else clock.veth
        result["veth_bytes_per_step"] = (steady[-1] - steady[0]) / max(len(steady) - 1, 1)
        with open(out_path, "w") as f:
            json.dump(result, f)


# ---- the comparison (pure) -----------------------------------------------------------
def smoothed(losses, window):
    """Trailing mean of the last `window` batch losses at every step."""
    out, total = [], 0.0
    for i, loss in enumerate(losses):
        total += loss - (losses[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def time_to_reach(wall_clock, curve, target, window):
    """Seconds from the end of the first step until `curve` (smoothed, defined from step
    `window - 1` on) first reaches `target`; None if it never does."""
    for i in range(window - 1, len(curve)):
        if curve[i] <= target:
            return wall_clock[i] - wall_clock[0]
    return None


def compare(runs, window):
    """Per aggregator: figures and their ratios to the `none` (fp32) run. Compressed runs
    may have run longer than fp32 (so that a run a little behind can still reach fp32's
    final loss); their final loss is taken at fp32's last step."""
    ref = runs["none"]
    ref_curve = smoothed(ref["loss_history"], window)
    steps, target = len(ref_curve), ref_curve[-1]
    ref_time = time_to_reach(ref["wall_clock_s"], ref_curve, target, window)
    ref_sps = 1000.0 / ref["step_time_ms"]["median"]
    table = {}
    for name, run in runs.items():
        curve = smoothed(run["loss_history"], window)
        reach = time_to_reach(run["wall_clock_s"], curve, target, window)
        final = curve[steps - 1]
        sps = 1000.0 / run["step_time_ms"]["median"]
        comm = run.get("comm", {})
        table[name] = {
            "bytes_on_wire_per_step": comm.get("bytes_on_wire_per_step"),
            "veth_bytes_per_step": run["veth_bytes_per_step"],
            "compression_ratio": comm.get("compression_ratio"),
            "steps_per_sec": sps, "speedup": sps / ref_sps,
            "comm_time_fraction": comm.get("comm_time_fraction"),
            "overlap_fraction": comm.get("overlap_fraction"),
            "seconds_to_fp32_loss": reach,
            "time_to_fp32_loss_speedup": (ref_time / reach) if reach else None,
            "final_loss": final, "final_loss_vs_fp32": final / target - 1,
        }
    return table


def goals(table):
    """The design's goals for slow links, each with the value reached and pass/fail."""
    out = {}
    for name, want in GOALS.items():
        if name in table:
            got = table[name]["speedup"]
            out[f"{name} steps/s >= {want}x fp32"] = {"value": got, "pass": got >= want}
    for name, row in table.items():
        if name == "none" or name in VARIANTS:
            continue
        speed = row["time_to_fp32_loss_speedup"]
        if name in ("powersgd", "topk"):  # fp16 cannot: it at most halves the bytes
            out[f"{name} time to fp32 loss >= 3x faster"] = {
                "value": speed, "pass": bool(speed and speed >= 3)}
        out[f"{name} final loss within 2% of fp32"] = {
            "value": row["final_loss_vs_fp32"], "pass": abs(row["final_loss_vs_fp32"]) <= 0.02}
    return out


def format_table(table, labels=None):
    """The comparison as text; `labels` renames rows (e.g. to show a setting)."""
    labels = labels or {}
    head = (f"{'aggregator':<13} {'MB/step':>8} {'veth MB':>8} {'ratio':>7} {'steps/s':>8} "
            f"{'× fp32':>7} {'comm %':>6} {'ovl %':>5} {'s→fp32 loss':>11} {'× faster':>8} "
            f"{'final loss':>10} {'vs fp32':>8}")
    lines = [head, "-" * len(head)]
    for name, r in table.items():
        wire = r["bytes_on_wire_per_step"]
        reach, faster = r["seconds_to_fp32_loss"], r["time_to_fp32_loss_speedup"]
        share, overlap = r["comm_time_fraction"], r.get("overlap_fraction")
        lines.append(
            f"{labels.get(name, name):<13} {wire / 1e6 if wire else math.nan:>8.3f} "
            f"{r['veth_bytes_per_step'] / 1e6:>8.3f} {r['compression_ratio'] or 1:>7.1f} "
            f"{r['steps_per_sec']:>8.2f} {r['speedup']:>7.2f} "
            f"{100 * share if share is not None else math.nan:>6.0f} "
            f"{100 * overlap if overlap is not None else math.nan:>5.0f} "
            f"{reach if reach is not None else math.nan:>11.1f} "
            f"{faster if faster else math.nan:>8.2f} {r['final_loss']:>10.4f} "
            f"{100 * r['final_loss_vs_fp32']:>+7.2f}%")
    return "\n".join(lines)


def plot(runs, window, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in runs.items():
        curve = smoothed(run["loss_history"], window)[window - 1:]
        wall = [t - run["wall_clock_s"][0] for t in run["wall_clock_s"]][window - 1:]
        by_time.plot(wall, curve, label=name)
        by_step.plot(range(window, window + len(curve)), curve, label=name)
    target = smoothed(runs["none"]["loss_history"], window)[-1]
    for ax, xlabel in ((by_time, "wall-clock seconds (after the first step)"),
                       (by_step, "step")):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"training loss (mean of last {window} batches)")
        ax.grid(alpha=0.3)
    by_time.set_xscale("log")
    by_time.legend()
    by_time.set_title("loss vs wall-clock (dotted: fp32's final loss)")
    by_step.set_title("loss vs step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


# ---- the driver ----------------------------------------------------------------------
def run_one(link, name, settings, out_dir, timeout, extra, comm_steps=3):
    """Trains with aggregator `name` (or a `VARIANTS` run) on the two sides of `link`;
    returns its metrics. `comm_steps`: timed steps of the communication share measured
    after training (0: not measured, for runs that only want steps/s)."""
    compression, changes = VARIANTS.get(name, (name, {}))
    config = dict(settings, compression=compression, strategy="multi_worker", verbose=0,
                  **changes)
    if name != "none":
        config["steps"] = config["steps_per_epoch"] = round(settings["steps"] * (1 + extra))
    out_path = os.path.abspath(os.path.join(out_dir, f"{name}.json"))
    if os.path.exists(out_path):
        os.remove(out_path)
    logs = [os.path.join(out_dir, f"{name}.worker{i}.log") for i in range(2)]
    codes, _ = link.run_workers(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(config), out_path],
        PORT, timeout, env={"PYTHONPATH": ROOT, "TFPAR_BENCH_COMM_STEPS": str(comm_steps)},
        log_paths=logs)
    if any(codes) or not os.path.exists(out_path):
        raise RuntimeError(f"{name}: workers exited {codes} (killed, negative: still running "
                           f"after {timeout:.0f}s); see {out_dir}/{name}.worker*.log")
    with open(out_path) as f:
        return json.load(f)


def machine_load():
    with open("/proc/loadavg") as f:
        one, five, fifteen = (float(v) for v in f.read().split()[:3])
    return {"loadavg_1_5_15": [one, five, fifteen], "cpus": os.cpu_count()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK)} only, 12 steps: a smoke run in < 3 min")
    parser.add_argument("--aggregators", default="",
                        help=f"comma-separated subset of {','.join(AGGREGATORS)} or "
                             f"{','.join(n for n in VARIANTS if n not in AGGREGATORS)} "
                             "(none is always run: it is the reference)")
    parser.add_argument("--rate", default="100mbit", help="tc rate of each direction")
    parser.add_argument("--topk_warmup_steps", type=int, default=10,
                        help="top-k's density warm-up (DGC): 25 %% of the entries at the "
                             "first step, decaying to 1 %% at this step; 0 = off")
    parser.add_argument("--powersgd_rank", type=int, default=4,
                        help="PowerSGD's rank: 4, as the compression benchmark's table and "
                             "PyTorch's peer "
                             "(the trainer's default is 16, chosen for quality)")
    parser.add_argument("--threshold", type=float, default=1e-3,
                        help="the threshold aggregator's threshold: 1e-3, as the compression "
                             "benchmark's "
                             "table (the trainer's default is 1e-4)")
    parser.add_argument("--steps", type=int, default=0, help="fp32's steps; default 150 "
                        "(quick: 12)")
    parser.add_argument("--extra", type=float, default=0.25,
                        help="compressed runs train this fraction longer than fp32, so that "
                             "one slightly behind can still reach fp32's final loss")
    parser.add_argument("--smooth", type=int, default=0,
                        help="batches in the loss mean; default steps/10, at least 5")
    parser.add_argument("--model_width", type=int, default=1024)
    parser.add_argument("--model_depth", type=int, default=7)
    parser.add_argument("--global_batch_size", type=int, default=32)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_compression.json"))
    parser.add_argument("--png", default=os.path.join(ROOT, "runs", "bench_compression.png"))
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG_JSON", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)

    from shaped_link import ShapedLink, ShapedLinkError

    names = [n for n in (args.aggregators.split(",") if args.aggregators
                         else QUICK if args.quick else AGGREGATORS) if n]
    unknown = sorted(set(names) - set(AGGREGATORS) - set(VARIANTS))
    if unknown:
        parser.error(f"--aggregators: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(dict.fromkeys(AGGREGATORS + tuple(VARIANTS)))}")
    if args.topk_warmup_steps < 0:
        parser.error(f"--topk_warmup_steps={args.topk_warmup_steps}: must be >= 0")
    names = ["none"] + [n for n in names if n != "none"]
    steps = args.steps or (12 if args.quick else 150)
    window = args.smooth or max(5, steps // 10)
    settings = {"model": "mlp", "model_width": args.model_width,
                "model_depth": args.model_depth, "global_batch_size": args.global_batch_size,
                "optimizer": args.optimizer, "learning_rate": args.learning_rate,
                "steps": steps, "steps_per_epoch": steps, "seed": 0,
                "topk_warmup_steps": args.topk_warmup_steps,
                # top-k as measured here (README): 1 %, one all-gather of every replica's own
                # pairs (the trainer's default is 10 % over the union since the quality suite)
                "topk_ratio": 0.01, "topk_union": False, "topk_dense_below": 0,
                "powersgd_rank": args.powersgd_rank, "threshold": args.threshold}
    out_dir = os.path.splitext(args.out)[0] + "_runs"
    os.makedirs(out_dir, exist_ok=True)
    load_before = machine_load()
    runs = {}
    try:
        with ShapedLink(rate=args.rate) as link:
            for name in names:
                print(f"[bench] {name}: {steps} steps ...", flush=True)
                runs[name] = run_one(link, name, settings, out_dir, args.timeout, args.extra)
                r = runs[name]
                print(f"[bench] {name}: {1000 / r['step_time_ms']['median']:.2f} steps/s, "
                      f"final loss {r['final_loss']:.4f}", flush=True)
    except ShapedLinkError as err:
        print(f"bench_compression: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"bench_compression: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"bench_compression: interrupted ({err or 'Ctrl-C'}); workers stopped, "
              "namespaces removed", file=sys.stderr)
        return 130
    table = compare(runs, window)
    verdicts = goals(table)
    params = runs["none"]["memory"]["params_per_device"][0]
    print(f"\n{params / 1e6:.2f} M parameters, 2 workers, {args.rate} each way, {steps} steps, "
          f"batch {args.global_batch_size}, {args.optimizer} lr {args.learning_rate}; "
          f"load before {load_before['loadavg_1_5_15']}, after "
          f"{machine_load()['loadavg_1_5_15']} on {os.cpu_count()} CPUs\n")
    labels = {"none": "none (fp32)", "topk_nowarmup": "topk, no wu",
              "topk_buckets": "topk, 4MB bkt", "none_keras": "fp32 Keras AR"}
    if args.topk_warmup_steps:
        labels["topk"] = f"topk, wu {args.topk_warmup_steps}"
        print(f"topk: 1 % of the entries, density warm-up 25 % -> 1 % over the first "
              f"{args.topk_warmup_steps} steps (those steps send more bytes: veth MB counts "
              f"them, MB/step is the last step's); topk, no wu: the same without warm-up\n")
    print(format_table(table, labels))
    print()
    for goal, v in verdicts.items():
        value = "n/a" if v["value"] is None else f"{v['value']:.3f}"
        print(f"  {'PASS' if v['pass'] else 'MISS'}  {goal}: {value}")
    report = {"setup": {**settings, "rate": args.rate, "workers": 2, "params": params,
                        "smooth_window": window},
              "machine": {"before": load_before, "after": machine_load()},
              "runs": runs, "comparison": table, "goals": verdicts}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(runs, window, args.png)
    print(f"\nwrote {args.out} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
