"""tfpar's aggregators against PyTorch DDP's comm hooks, interleaved on the same shaped link.

For each round (`--rounds`), global batch (`--batches`, default 32 and 256) and mode
(`--modes`: fp32, fp16, PowerSGD rank 4): `tools/bench_compression.py`'s worker pair (two
tfpar workers in network namespaces joined by a `tc tbf` veth pair, the one mode alone) and
the PyTorch peer (`run_ddp_shaped.sh` from `--peer_dir`: two gloo ranks in their own
namespaces, the same rate, the same mode), back to back, which side goes first alternating
from round to round, so both sides see the same machine hour. Same model size (MLP of ~6.3 M
parameters), batch, optimizer (momentum SGD, lr 0.01) and steps. Prints per side the median
steps/s over rounds with its min–max, and the ratio of the medians tfpar / PyTorch with the
min–max of the per-round ratios (each round's two sides ran minutes apart); the load average
at every side change goes to `--out` (JSON). Needs root, iproute2 and the peer's own Python
(`--torch_py`). Each table and its JSON (`resources`) state what each side had: the
peer's ranks and `torch.set_num_threads` from its own records (1 per rank), tfpar's two
workers and their TensorFlow thread settings as they recorded them (by default 0: TensorFlow
sizes its pools itself; `--tfpar_env='{"TF_NUM_INTRAOP_THREADS": "1",
"TF_NUM_INTEROP_THREADS": "1"}'` gives each worker pools of one thread, as the peer's ranks).

    python tools/bench_compression_vs_torch.py --peer_dir=../shared/peers \
        --torch_py=$HOME/.venvs/torch-peer/bin/python --rounds=3
    # this checkout with a setting changed against --base_root's defaults
    python tools/bench_compression_vs_torch.py ... --base_root=. \
        --tfpar_settings='{"fused_update": true}'
    # round 2 alone (the side that went second in round 1 goes first)
    python tools/bench_compression_vs_torch.py ... --rounds=1 --first_round=2
    # a reduced run: PowerSGD only, 2 rounds, 16 steps
    python tools/bench_compression_vs_torch.py ... --rounds=2 --modes=powersgd --steps=16
    # before/after a change: another checkout's tfpar as a third side in every round
    python tools/bench_compression_vs_torch.py ... --base_root=../tfpar-before

Take the CPU lock yourself (one command): both sides must run in one sitting.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import side_resources  # noqa: E402
MODES = {"none": "fp32", "fp16": "fp16", "powersgd": "powersgd"}  # tfpar name -> peer's
PEER_NAMES = {v: k for k, v in MODES.items()}


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def bench_module(root):
    """`tools/bench_compression.py` of the checkout at `root` (None: this one); its workers run
    that checkout's tfpar."""
    if root is None:
        import bench_compression
        return bench_compression
    import importlib.util
    path = os.path.join(os.path.abspath(root), "tools", "bench_compression.py")
    spec = importlib.util.spec_from_file_location(f"bench_compression_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tfpar(mode, batch, steps, rate, out_dir, timeout, root=None, extra_settings=None,
              env=None):
    """`(steps/s, resources)` of tfpar's `mode` (a tfpar aggregator name): the median step
    of `fit`, and the two workers' processes and TensorFlow threads (`side_resources`; not
    recorded by a `root` checkout that predates it); `extra_settings`: more `ParallelConfig`
    settings for the workers; `env`: more environment variables for them (e.g.
    `TF_NUM_INTRAOP_THREADS`)."""
    saved = dict(os.environ)
    os.environ.update(env or {})  # the workers' environment is read from os.environ
    try:
        return _run_tfpar(mode, batch, steps, rate, out_dir, timeout, root, extra_settings)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run_tfpar(mode, batch, steps, rate, out_dir, timeout, root, extra_settings):
    bench_compression = bench_module(root)
    from shaped_link import ShapedLink

    settings = {"model": "mlp", "model_width": 1024, "model_depth": 7,
                "global_batch_size": batch, "optimizer": "momentum", "learning_rate": 0.01,
                "steps": steps, "steps_per_epoch": steps, "seed": 0,
                "powersgd_rank": 4,  # the peer's rank (the trainer's default is 16)
                **(extra_settings or {})}
    os.makedirs(out_dir, exist_ok=True)
    with ShapedLink(rate=rate) as link:
        run = bench_compression.run_one(link, mode, settings, out_dir, timeout, extra=0,
                                        comm_steps=0)
    resources = side_resources.tensorflow_side(
        run["workers"], run.get("tensorflow_threads"), "one CPU replica per worker")
    return 1000 / run["step_time_ms"]["median"], resources


def run_peer(peer_dir, torch_py, mode, batch, steps, rate, log_dir, timeout):
    """`(steps/s, resources)` of the peer's `mode` (a peer name): the slower rank's rate, and
    its ranks and `torch.set_num_threads` as its records state (`world`, `threads`)."""
    tag = f"b{batch}_{mode}"
    env = {**os.environ, "TORCH_PY": torch_py, "STEPS": str(steps), "UNSHAPED": "0",
           "MODES": mode, "EXTRA": f"--global_batch {batch}", "TAG": tag, "LOGDIR": log_dir}
    path = os.path.join(log_dir, f"{tag}_shaped_{rate}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    proc = subprocess.run(["bash", os.path.join(peer_dir, "run_ddp_shaped.sh"), rate], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if not os.path.exists(path):
        raise RuntimeError(f"peer wrote no results ({proc.returncode}): {proc.stderr[-2000:]}")
    rate_of, resources = float("nan"), side_resources.torch_side(2, None)
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if d.get("label") != mode or "error" in d:
                continue
            # The slower rank sets the pace.
            rate_of = d["steps_per_s"] if rate_of != rate_of else min(rate_of, d["steps_per_s"])
            resources = side_resources.torch_side(d.get("world", 2), d.get("threads"),
                                                  "DDP, gloo")
    return rate_of, resources


def spread(values):
    """`{"median", "min", "max"}` of the finite `values` (NaN when there are none)."""
    values = [v for v in values if v == v]
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds, modes, sides=("tfpar", "torch")):
    """Per mode over `rounds` (`[{"tfpar": {mode: sps}, "torch": {mode: sps}}, ...]`, plus
    "base" with `--base_root`): each side's spread, the ratio of the medians and the
    per-round ratios' spread, tfpar / torch (and base / torch, tfpar / base)."""
    out = {}
    for m in modes:
        out[m] = {side: spread([r[side].get(m, float("nan")) for r in rounds])
                  for side in sides}
        for num, den, key in (("tfpar", "torch", ""), ("base", "torch", "base_"),
                              ("tfpar", "base", "vs_base_")):
            if num not in sides or den not in sides:
                continue
            per_round = [r[num][m] / r[den][m] for r in rounds
                         if r[num].get(m) and r[den].get(m)]
            out[m][f"{key}ratio_of_medians"] = (out[m][num]["median"] /
                                                out[m][den]["median"])
            out[m][f"{key}ratio_per_round"] = per_round
            out[m][f"{key}ratio_range"] = spread(per_round)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer_dir", required=True, help="directory holding run_ddp_shaped.sh")
    p.add_argument("--torch_py", required=True, help="the peer's Python (with torch)")
    p.add_argument("--batches", default="32,256", help="comma-separated global batch sizes")
    p.add_argument("--modes", default="fp32,fp16,powersgd",
                   help="comma-separated subset of fp32,fp16,powersgd (tfpar's names none, "
                        "fp16, powersgd are accepted too)")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleaved rounds; each runs every batch and mode on both sides")
    p.add_argument("--steps", type=int, default=32,
                   help="steps per run (the peer times those after its 12 untimed ones)")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "compression_vs_torch.json"))
    p.add_argument("--tfpar_settings", type=json.loads, default={},
                   help="JSON of more ParallelConfig settings for this checkout's side only "
                        "(not --base_root's), e.g. '{\"fused_update\": true}'")
    p.add_argument("--tfpar_env", type=json.loads, default={},
                   help="JSON of environment variables for this checkout's workers only, "
                        "e.g. '{\"TF_ENABLE_ONEDNN_OPTS\": \"1\"}'")
    p.add_argument("--first_round", type=int, default=1,
                   help="number of the first round: who goes first alternates with it, so "
                        "rounds split over several invocations (each under the CPU lock's "
                        "10 minutes) keep alternating")
    p.add_argument("--base_root", default=None,
                   help="another checkout of tfpar run as a third side in every round "
                        "(\"base\": before/after a change, in one sitting)")
    args = p.parse_args()
    modes = [PEER_NAMES.get(m, m) for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(PEER_NAMES)}")
    modes = [MODES[m] for m in modes]  # the peer's names from here on
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: must be >= 1")
    if args.steps <= 12:
        p.error(f"--steps={args.steps}: must be > 12 (the peer's untimed steps)")
    work = os.path.abspath(os.path.splitext(args.out)[0])  # base workers run in base_root
    os.makedirs(work, exist_ok=True)
    peer_dir = os.path.abspath(args.peer_dir)
    per_batch = {b: [] for b in batches}
    # Which side goes first alternates from round to round.
    all_sides = ["tfpar", "torch"] if args.base_root is None else ["tfpar", "torch", "base"]
    for i in range(args.first_round - 1, args.first_round - 1 + args.rounds):
        for batch in batches:
            row = {side: {} for side in all_sides}
            row["loads"], row["resources"] = [loadavg()], {}
            for mode in modes:
                sides = all_sides if i % 2 == 0 else all_sides[::-1]
                for side in sides:
                    if side == "torch":
                        row["torch"][mode], row["resources"][side] = run_peer(
                            peer_dir, args.torch_py, mode, batch, args.steps, args.rate, work,
                            args.timeout)
                    else:
                        row[side][mode], row["resources"][side] = run_tfpar(
                            PEER_NAMES[mode], batch, args.steps, args.rate,
                            os.path.join(work, f"{side}_b{batch}"), args.timeout,
                            root=args.base_root if side == "base" else None,
                            extra_settings=None if side == "base" else args.tfpar_settings,
                            env=None if side == "base" else args.tfpar_env)
                    row["loads"].append(loadavg())
                got = ", ".join(f"{side} {row[side][mode]:.3f}" for side in all_sides)
                print(f"round {i + 1} batch {batch} {mode:8}: {got} steps/s "
                      f"({' then '.join(sides)}; load {row['loads'][-1]})", flush=True)
            per_batch[batch].append(row)
    report = {"args": vars(args), "batches": {}}
    print(f"\n{args.rounds} interleaved round(s), {args.steps} steps, {args.rate}; "
          "steps/s median [min–max over rounds]")
    for batch in batches:
        rounds = per_batch[batch]
        stats = summarize(rounds, modes, all_sides)
        # What each side had, from every run's own record (one entry when all agree).
        resources = {side: side_resources.distinct([r["resources"][side] for r in rounds])
                     for side in all_sides}
        report["batches"][batch] = {
            "resources": resources,
            # The keys of the one-round tool: medians over rounds, the first round's loads.
            "load_before": rounds[0]["loads"][0], "load_between": rounds[0]["loads"][1],
            "load_after": rounds[-1]["loads"][-1],
            "tfpar": {m: stats[m]["tfpar"]["median"] for m in modes},
            "torch": {m: stats[m]["torch"]["median"] for m in modes},
            "ratio": {m: stats[m]["ratio_of_medians"] for m in modes},
            "rounds": rounds, "stats": stats}
        print(f"batch {batch}:")
        print(f"  {side_resources.resources_line(resources)}")
        print(f"  {'mode':9} {'tfpar steps/s':>24} {'torch steps/s':>24} "
              f"{'tfpar/torch (per round)':>26}")
        for m in modes:
            s = stats[m]
            cell = {k: f"{s[k]['median']:.3f} [{s[k]['min']:.3f}–{s[k]['max']:.3f}]"
                    for k in ("tfpar", "torch")}
            r = s["ratio_range"]
            print(f"  {m:9} {cell['tfpar']:>24} {cell['torch']:>24} "
                  f"{s['ratio_of_medians']:>10.2f} [{r['min']:.2f}–{r['max']:.2f}]", flush=True)
            if "base" in s:
                b, rb, rv = (s["base"], s["base_ratio_range"], s["vs_base_ratio_range"])
                print(f"  {'  base':9} {b['median']:.3f} [{b['min']:.3f}–{b['max']:.3f}]"
                      f"{'':>1} base/torch {s['base_ratio_of_medians']:.2f} "
                      f"[{rb['min']:.2f}–{rb['max']:.2f}], tfpar/base "
                      f"{s['vs_base_ratio_of_medians']:.2f} [{rv['min']:.2f}–{rv['max']:.2f}]",
                      flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
