"""ZeRO-3's bytes on the wire per step with ZeRO++'s compressed collectives.

Trains the same model, seed and batches with plain ZeRO-3 (fp32 weight gathers, DTensor's
fp32 gradient reduction), the int8 weight gather alone (`--zero_gather=int8`), the
compressed gradient reduce-scatter alone (`--compression=int8|fp16`) and both, each in its
own `python -m tfpar.train` process on a `--cpu_devices` mesh, and prints per run the
bytes one device hands to the collectives per step (the metrics JSON's `comm` block: a
count from the shapes, see `tfpar.metrics.zero3_comm_stats`), its ratio to plain
ZeRO-3's, and the final loss. Writes `--out` (JSON).

    python tools/bench_zero_comm.py                        # mlp, 2 devices, 50 steps
    python tools/bench_zero_comm.py --model=transformer --steps=100
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_run import train  # noqa: E402

RUNS = (("zero3", []),
        ("zero3 + int8 gather", ["--zero_gather=int8"]),
        ("zero3 + fp16 reduce-scatter", ["--compression=fp16"]),
        ("zero3 + int8 reduce-scatter", ["--compression=int8"]),
        ("zero3 + int8 gather + int8 reduce-scatter", ["--zero_gather=int8",
                                                       "--compression=int8"]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mlp", choices=("mlp", "transformer"))
    p.add_argument("--cpu_devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default="runs/zero_comm.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    base = [f"--model={args.model}", f"--cpu_devices={args.cpu_devices}", "--zero_stage=3",
            f"--steps={args.steps}", f"--optimizer={args.optimizer}"]
    rows, plain = [], None
    print(f"{'run':44} {'B/step':>10} {'vs zero3':>8} {'final loss':>10}", flush=True)
    for name, flags in RUNS:
        metrics, error, _ = train(base + flags, args.timeout)
        if error is not None:
            print(f"{name:44} failed: {error}", flush=True)
            rows.append({"run": name, "flags": flags, "error": error})
            continue
        wire = metrics["comm"]["bytes_on_wire_per_step"]
        plain = plain or (wire if not flags else None)
        ratio = wire / plain if plain else float("nan")
        print(f"{name:44} {wire:10d} {ratio:8.3f} {metrics['final_loss']:10.4f}", flush=True)
        rows.append({"run": name, "flags": flags, "bytes_on_wire_per_step": wire,
                     "vs_zero3": ratio, "final_loss": metrics["final_loss"]})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
