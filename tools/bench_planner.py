"""The planner against measurement: predicted vs measured step times on a grid, and the
planner's choice vs the best measured configuration.

Calibrates the cost model on this machine (`python -m tfpar.plan --calibrate`), then runs a
grid of layouts the trainer can run here for `--steps` steps each, one process per run,
`--repeats` times each (rounds interleaved, so slow spells hit every layout): the planner's
top `--top` layouts, every tensor-parallel layout it ranked, and its `--low` lowest-ranked
layouts, and compares the planner's choice with the best measured median.

Calibration and validation are separate runs at different batches: calibration fits the
cost model's per-unit costs to runs of the same model at half and 4 times
`--global_batch_size` (all-device data parallelism at both, each aggregator and 2-stage
pipelines with 2, 4, 8 micro-batches at half); every run compared here is at
`--global_batch_size` itself, a batch the fit never saw.

    python tools/bench_planner.py                    # mlp (width 1024), 4 logical CPUs
    python tools/bench_planner.py --quick            # 5 configurations, 2 repeats, a few steps

Goals (the design's): the choice within 10 % of the best measured; predictions within 30 %.
Prints a table and writes JSON (`--out`, default runs/bench_planner.json).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, timeout=900):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return out.stdout


def label(r):
    return (f"dp={r['data']} tp={r['tensor']} pp={r['pipeline']} mb={r['microbatches']} "
            f"{'chimera ' if r.get('schedule') == 'chimera' else ''}{r['compression']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--model_width", type=int, default=1024)
    parser.add_argument("--global_batch_size", type=int, default=256)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=8, help="planner's best layouts to run")
    parser.add_argument("--low", type=int, default=3, help="lowest-ranked layouts to run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_planner.json"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.top, args.low, args.repeats = 12, 2, 1, 2
    common = [f"--model={args.model}", f"--model_width={args.model_width}",
              f"--global_batch_size={args.global_batch_size}", f"--cpu_devices={args.devices}"]
    plan = json.loads(run([sys.executable, "-m", "tfpar.plan", "--calibrate", "--json",
                           *common]))
    print(f"calibration ({len(plan['calibration']['runs'])} runs, fitted on these):")
    for r in plan["calibration"]["runs"]:
        print(f"  {label(r):<34}batch {r['global_batch_size']:<6}measured "
              f"{r['measured_ms']:7.2f} ms  fitted {r['fitted_ms']:7.2f} ms")
    ranked = [r for r in plan["ranked"] if r["runnable"] is None]
    grid = ranked[:args.top]
    grid += [r for r in ranked if r["tensor"] > 1 and r not in grid][:2]
    grid += [r for r in ranked[-args.low:] if r not in grid]
    choice = grid[0]
    rows = [{**{k: row[k] for k in ("data", "tensor", "pipeline", "microbatches",
                                    "compression", "schedule")},
             "rank": ranked.index(row) + 1, "predicted_ms": 1000 * row["step_seconds"],
             "measured": []} for row in grid]
    for repeat in range(args.repeats):
        for i, row in enumerate(grid):
            batch, flags = args.global_batch_size, [f"--data_parallel={row['data']}",
                                                    f"--compression={row['compression']}"]
            if row["pipeline"] > 1:
                flags += [f"--pipeline_stages={row['pipeline']}",
                          f"--microbatches={row['microbatches']}",
                          f"--schedule={row['schedule']}"]
            elif row["microbatches"] > 1:  # micro-batches without a pipeline: accumulation
                batch //= row["microbatches"]
                flags += [f"--grad_accum_steps={row['microbatches']}"]
            if row["tensor"] > 1:
                flags += [f"--tensor_parallel={row['tensor']}"]
            path = os.path.join(ROOT, "runs", "bench_planner", f"run_{i}_{repeat}.json")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            run([sys.executable, "-m", "tfpar.train", *common[:-2],
                 f"--global_batch_size={batch}", common[-1], *flags, f"--steps={args.steps}",
                 f"--steps_per_epoch={args.steps}", "--verbose=0", f"--metrics_json={path}"])
            with open(path) as f:
                rows[i]["measured"].append(json.load(f)["step_time_ms"]["median"])
    for r in rows:
        r["measured_ms"] = statistics.median(r["measured"])
    best = min(rows, key=lambda r: r["measured_ms"])
    chosen = rows[0]
    for r in rows:
        r["error"] = r["predicted_ms"] / r["measured_ms"] - 1
    within = sum(abs(r["error"]) <= 0.30 for r in rows)
    print(f"{'layout':<34}{'rank':>5}{'predicted ms':>14}{'measured ms':>13}"
          f"{'min..max':>16}{'error':>8}")
    for r in rows:
        name = label(r)
        mark = " <- planner" if r is chosen else (" <- best" if r is best else "")
        spread = f"{min(r['measured']):.1f}..{max(r['measured']):.1f}"
        print(f"{name:<34}{r['rank']:>5}{r['predicted_ms']:>14.2f}{r['measured_ms']:>13.2f}"
              f"{spread:>16}{r['error']:>+8.0%}{mark}")
    gap = chosen["measured_ms"] / best["measured_ms"] - 1
    print(f"planner's choice is {gap:.1%} slower than the best measured median (goal <= 10%); "
          f"{within}/{len(rows)} predictions within 30%; {args.repeats} runs of each, "
          f"{len(ranked)} runnable layouts ranked")
    with open(args.out, "w") as f:
        json.dump({"hardware": plan["hardware"], "calibration": plan["calibration"],
                   "runs": rows, "choice_gap": gap,
                   "within_30_percent": within, "count": len(rows)}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
