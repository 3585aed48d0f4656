"""The hierarchical all-reduce against the flat ring, two hosts × two workers, slow link.

Two network namespaces stand in for two hosts (tools/shaped_link.py), two worker processes
in each (`MultiWorkerMirroredStrategy`, one CPU replica each). Between the hosts the veth
pair is shaped to `--rate` each way (tbf), with `--delay_ms` of delay if asked (netem: the
kernel needs sch_netem); inside a host the workers talk over its own loopback, unshaped. Each round trains the same MLP from the same
seed with `python -m tfpar.train --compression=none` (fp32 buckets) once with
`--allreduce=flat` and once with `--allreduce=hierarchical`, the order alternating from
round to round.

    python tools/bench_hierarchical.py                 # 3 rounds, 30 steps each
    python tools/bench_hierarchical.py --rounds=1 --steps=12    # a smoke run

Needs root (namespaces, tc) and iproute2. Per run: steps/s (1000 / the metrics JSON's
median step time, first 2 steps left out), the bytes the veth carried across hosts per step
(both directions, kernel counters over the whole run / steps: startup's handshakes
included), and `comm.allreduce` as the run reported it; beside them the steps/s if the link
were the only cost (`ceilings`: at 2 hosts × 2 workers the hierarchical rings carry 1/1.5
of the flat ring's bytes each way, so a bandwidth-bound step gains at most 1.5×; delay
favours it further, 2 rounds across the link against the flat ring's 6). Prints a table
and the ratio of steps/s per round; writes `--out` (JSON: every run's metrics, the link, the machine's load).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import shaped_link  # noqa: E402

MODES = ("flat", "hierarchical")
GOAL = 1.5  # hierarchical steps/s over the flat ring's (issue 44)
PORT = 24560


def add_delay(link, rate, delay_ms):
    """Replaces each side's token bucket by netem: `rate` and `delay_ms` each way."""
    for ns, dev in zip(link.namespaces, link.devices):
        shaped_link._run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev,
                         "root", "netem", "delay", f"{delay_ms}ms", "rate", rate,
                         "limit", "10000")


def run_one(link, mode, args, out_dir):
    """One 4-worker run with `--allreduce=mode`: `(metrics, bytes across hosts)`."""
    ports = [PORT + i for i in range(4)]
    cluster = [f"{link.address(i // 2)}:{p}" for i, p in enumerate(ports)]
    metrics = os.path.join(out_dir, f"{mode}.json")
    flags = ["--strategy=multi_worker", "--model=mlp", f"--model_width={args.width}",
             f"--model_depth={args.depth}", "--optimizer=sgd", "--compression=none",
             f"--bucket_mb={args.bucket_mb}",
             f"--allreduce={mode}", f"--steps={args.steps}", f"--steps_per_epoch={args.steps}",
             f"--global_batch_size={args.batch}", "--verbose=0", "--seed=0",
             "--collective_timeout_s=300", f"--metrics_json={metrics}"]
    before = link.tx_bytes(0) + link.tx_bytes(1)
    procs = []
    for i in range(4):
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CONFIG=json.dumps({"cluster": {"worker": cluster},
                                         "task": {"type": "worker", "index": i}}))
        log = open(os.path.join(out_dir, f"{mode}.worker{i}.log"), "w")
        procs.append(link.popen(i // 2, [sys.executable, "-m", "tfpar.train", *flags],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll()]
            if failed or time.monotonic() > deadline:
                why = (f"worker {failed[0]} exited {procs[failed[0]].returncode}" if failed
                       else f"timed out after {args.timeout:.0f}s")
                raise RuntimeError(f"{mode}: {why}; see {out_dir}/{mode}.worker*.log")
            time.sleep(0.2)
    finally:
        link.kill_all()
    with open(metrics) as f:
        return json.load(f), link.tx_bytes(0) + link.tx_bytes(1) - before


def link_bytes_per_sec(rate):
    """tc's rate ("100mbit", "1gbit", "500kbit") in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale / 8
    raise SystemExit(f"--rate={rate!r} is invalid: use e.g. 100mbit, 1gbit or 500kbit")


def ceilings(grad_bytes, rate, workers=4, hosts=2):
    """Steps/s if the link between the hosts were the only cost: the flat ring's hops that
    cross it carry `2 (n - 1) / n` of the gradients each way, the hierarchical sum's rings
    across hosts `2 (h - 1) / h` between them (one ring of the leaders, or one a piece)."""
    per_sec = link_bytes_per_sec(rate)
    return {"flat": per_sec / (2 * (workers - 1) / workers * grad_bytes),
            "hierarchical": per_sec / (2 * (hosts - 1) / hosts * grad_bytes)}


def machine_load():
    with open("/proc/loadavg") as f:
        return [float(v) for v in f.read().split()[:3]]


def summarize(rounds):
    """Per mode: median steps/s and its range over rounds; the per-round ratio."""
    table = {}
    for mode in MODES:
        rates = [r[mode]["steps_per_sec"] for r in rounds]
        table[mode] = {"steps_per_sec_median": statistics.median(rates),
                       "steps_per_sec_min": min(rates), "steps_per_sec_max": max(rates),
                       "bytes_across_hosts_per_step": statistics.median(
                           r[mode]["bytes_across_hosts_per_step"] for r in rounds),
                       "allreduce": sorted({r[mode]["allreduce"] for r in rounds})}
    ratios = [r["hierarchical"]["steps_per_sec"] / r["flat"]["steps_per_sec"] for r in rounds]
    return table, ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--bucket_mb", type=float, default=1.0,
                        help="one kernel a bucket: a bucket's reduce inside the host may run "
                             "while the one before crosses (tfpar.compression.hierarchical)")
    parser.add_argument("--rate", default="100mbit", help="between the hosts, each way")
    parser.add_argument("--delay_ms", type=float, default=0.0,
                        help="between the hosts (netem; 0: tbf's rate only)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_hierarchical.json"))
    args = parser.parse_args()

    load_before = machine_load()
    rounds = []
    try:
        with shaped_link.ShapedLink(rate=args.rate) as link, \
                tempfile.TemporaryDirectory() as out_dir:
            if args.delay_ms:
                add_delay(link, args.rate, args.delay_ms)
            for r in range(args.rounds):
                result = {}
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    metrics, across = run_one(link, mode, args, out_dir)
                    result[mode] = {
                        "steps_per_sec": 1000.0 / metrics["step_time_ms"]["median"],
                        "bytes_across_hosts_per_step": across / metrics["steps"],
                        "allreduce": metrics["comm"]["allreduce"], "metrics": metrics}
                    print(f"round {r + 1} {mode:>12}: {result[mode]['steps_per_sec']:.2f} "
                          f"steps/s", flush=True)
                rounds.append(result)
    except shaped_link.ShapedLinkError as err:
        sys.exit(f"bench_hierarchical: {err}")
    table, ratios = summarize(rounds)
    grad_bytes = rounds[0]["flat"]["metrics"]["comm"]["bytes_uncompressed_per_step"]
    ceiling = ceilings(grad_bytes, args.rate)
    for mode in MODES:
        table[mode]["link_bound_steps_per_sec"] = ceiling[mode]
    load = {"before": load_before, "after": machine_load(), "cpus": os.cpu_count()}
    print(f"\n2 hosts x 2 workers, {args.rate} + {args.delay_ms:g} ms between hosts, MLP "
          f"width {args.width} depth {args.depth}, fp32 buckets of {args.bucket_mb:g} MB, "
          f"batch {args.batch}, "
          f"{args.steps} steps, {args.rounds} interleaved rounds")
    print(f"{'allreduce':>13} | steps/s median (min-max) | link-bound steps/s | "
          f"MB across hosts/step | reported")
    for mode in MODES:
        t = table[mode]
        print(f"{mode:>13} | {t['steps_per_sec_median']:6.2f} ({t['steps_per_sec_min']:.2f}-"
              f"{t['steps_per_sec_max']:.2f})        | {t['link_bound_steps_per_sec']:18.2f} | "
              f"{t['bytes_across_hosts_per_step'] / 1e6:20.2f} | {','.join(t['allreduce'])}")
    print(f"hierarchical / flat steps/s per round: {', '.join(f'{x:.2f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f}; goal >= {GOAL}; link-bound "
          f"{ceiling['hierarchical'] / ceiling['flat']:.2f})")
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']} on "
          f"{load['cpus']} CPUs")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "table": table, "ratios": ratios, "load": load,
                   "rounds": rounds}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
