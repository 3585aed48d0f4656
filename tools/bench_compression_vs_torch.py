"""tfpar's aggregators against PyTorch DDP's comm hooks, back to back on the same shaped link.

For each global batch in `--batches` (default 32 and 256): `tools/bench_compression.py`
(two tfpar workers in network namespaces joined by a `tc tbf` veth pair) with fp32, fp16 and
PowerSGD rank 4, then the PyTorch peer (`run_ddp_shaped.sh` from `--peer_dir`: two gloo
ranks in their own namespaces, the same rate) with the same modes, the same model size (MLP of
~6.3 M parameters), batch, optimizer (momentum SGD, lr 0.01) and steps. Prints steps/s of
each and the ratio tfpar / PyTorch, with the load average before and after each side; writes
`--out` (JSON). Needs root, iproute2 and the peer's own Python (`--torch_py`).

    python tools/bench_compression_vs_torch.py --peer_dir=../shared/peers \
        --torch_py=$HOME/.venvs/torch-peer/bin/python

Take the CPU lock yourself (one command): both sides must run in one sitting.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"none": "fp32", "fp16": "fp16", "powersgd": "powersgd"}  # tfpar name -> peer's


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run_tfpar(batch, steps, rate, out, timeout):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_compression.py"),
           f"--aggregators={','.join(MODES)}", f"--global_batch_size={batch}",
           "--optimizer=momentum", "--learning_rate=0.01", f"--steps={steps}", "--extra=0",
           f"--rate={rate}", f"--out={out}", f"--png={os.path.splitext(out)[0]}.png"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_compression.py failed ({proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    with open(out) as f:
        runs = json.load(f)["runs"]
    return {MODES[k]: 1000 / runs[k]["step_time_ms"]["median"] for k in MODES}


def run_peer(peer_dir, torch_py, batch, steps, rate, log_dir, timeout):
    env = {**os.environ, "TORCH_PY": torch_py, "STEPS": str(steps), "UNSHAPED": "0",
           "MODES": " ".join(MODES.values()), "EXTRA": f"--global_batch {batch}",
           "TAG": f"b{batch}", "LOGDIR": log_dir}
    proc = subprocess.run(["bash", os.path.join(peer_dir, "run_ddp_shaped.sh"), rate], env=env,
                          capture_output=True, text=True, timeout=timeout)
    path = os.path.join(log_dir, f"b{batch}_shaped_{rate}.jsonl")
    if not os.path.exists(path):
        raise RuntimeError(f"peer wrote no results ({proc.returncode}): {proc.stderr[-2000:]}")
    rates = {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if "error" in d:
                rates[d["label"]] = float("nan")
            else:  # the slower rank sets the pace
                rates[d["label"]] = min(rates.get(d["label"], 1e9), d["steps_per_s"])
    return rates


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer_dir", required=True, help="directory holding run_ddp_shaped.sh")
    p.add_argument("--torch_py", required=True, help="the peer's Python (with torch)")
    p.add_argument("--batches", default="32,256")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "compression_vs_torch.json"))
    args = p.parse_args()
    work = os.path.splitext(args.out)[0]
    os.makedirs(work, exist_ok=True)
    report = {"args": vars(args), "batches": {}}
    for batch in [int(b) for b in args.batches.split(",") if b]:
        row = {"load_before": loadavg()}
        row["tfpar"] = run_tfpar(batch, args.steps, args.rate,
                                 os.path.join(work, f"tfpar_b{batch}.json"), args.timeout)
        row["load_between"] = loadavg()
        row["torch"] = run_peer(os.path.abspath(args.peer_dir), args.torch_py, batch,
                                args.steps, args.rate, work, args.timeout)
        row["load_after"] = loadavg()
        row["ratio"] = {m: row["tfpar"][m] / row["torch"][m] for m in MODES.values()
                        if row["torch"].get(m)}
        report["batches"][batch] = row
        print(f"batch {batch} (load {row['load_before']} / {row['load_between']} / "
              f"{row['load_after']}):")
        print(f"  {'mode':9} {'tfpar steps/s':>13} {'torch steps/s':>13} {'tfpar/torch':>11}")
        for m in MODES.values():
            print(f"  {m:9} {row['tfpar'][m]:13.3f} {row['torch'].get(m, float('nan')):13.3f} "
                  f"{row['ratio'].get(m, float('nan')):11.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
