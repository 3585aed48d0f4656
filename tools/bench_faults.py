"""Injected worker deaths over a 2-worker run: faults survived, steps lost, time to recover.

A fault-free run and a run with `--faults` SIGKILLs (alternating workers, spread over the
run, via `TFPAR_INJECT_FAULTS`) under `tfpar.launch --max_restarts`, side by side. Steps lost
are read from the resumed runs' logs ("resuming ... at step S"); time to recover is from a
kill to the restarted workers being ready again (strategy built, checkpoint next).

    python tools/bench_faults.py                 # 3 faults over 300 steps
    python tools/bench_faults.py --quick         # 1 fault over 60 steps

Prints a table and writes JSON (`--out`, default runs/bench_faults.json).

`--elastic`: a worker lost for good instead. `tfpar.launch --workers=4 --min_workers=3`
(and `--workers=2 --min_workers=1`): the last worker slot SIGKILLs itself at a random step
(`--seed`) and exits at once in every later attempt (its machine is gone); after
`--lost_after=2` failed attempts the launcher drops it and the others resume from the last
checkpoint. Each job runs side by side with the uninterrupted job on the full count; the
table gives the step lost at, the step resumed at (steps repeated), the seconds from the
loss being declared to training resuming (the launcher's own line), and the final losses
(default out: runs/bench_elastic.json).

    python tools/bench_faults.py --elastic       # 4 -> 3 and 2 -> 1 workers, 200 steps
"""

import argparse
import json
import random
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_job(args, plan, metrics_path, ckpt):
    cmd = [sys.executable, "-m", "tfpar.launch", "--workers=2", f"--max_restarts={len(plan)}",
           "--grace=2", "--timeout=1200", "--", sys.executable, "-m", "tfpar.train",
           "--strategy=multi_worker", f"--steps={args.steps}", "--steps_per_epoch=50",
           f"--checkpoint_every={args.checkpoint_every}", f"--checkpoint_dir={ckpt}",
           f"--metrics_json={metrics_path}", "--verbose=0", f"--model={args.model}"]
    env = dict(os.environ, TFPAR_INJECT_FAULTS=",".join(f"{w}:{s}" for w, s in plan))
    began = time.monotonic()
    events = []  # (seconds, kind, value)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        now = time.monotonic() - began
        if "tfpar.faults: killing" in line:
            events.append((now, "kill", int(line.rsplit(" ", 1)[1])))
        elif "TFPAR_READY" in line:
            events.append((now, "ready", None))
        elif (m := re.search(r"resuming from .* at step (\d+)", line)):
            events.append((now, "resume", int(m.group(1))))
    proc.wait()
    total = time.monotonic() - began
    if proc.returncode:
        raise SystemExit(f"job failed (exit {proc.returncode}) with plan {plan}")
    return total, events


# The lost machine: the last slot exits at once from its second attempt on.
WRAPPER = ("import os, sys\n"
           "if os.environ['TFPAR_SLOT'] == os.environ['LOST_SLOT'] and "
           "os.environ['TFPAR_RESTART'] != '0':\n"
           "    sys.exit('worker slot ' + os.environ['LOST_SLOT'] + ': no machine')\n"
           "os.execv(sys.executable, [sys.executable] + sys.argv[1:])\n")


def run_elastic(args, workers, lost_step, work):
    """One elastic job losing its last slot at `lost_step` (None: uninterrupted)."""
    tag = f"{workers}_{lost_step or 'whole'}"
    metrics_path = os.path.join(work, f"metrics_{tag}.json")
    train = ["-m", "tfpar.train", "--strategy=multi_worker", f"--steps={args.steps}",
             "--steps_per_epoch=50", f"--checkpoint_every={args.checkpoint_every}",
             f"--checkpoint_dir={os.path.join(work, f'ckpt_{tag}_{os.getpid()}')}",
             f"--metrics_json={metrics_path}", "--verbose=0", f"--model={args.model}",
             "--global_batch_size=48", "--collective_timeout_s=60"]
    cmd = [sys.executable, "-m", "tfpar.launch", f"--workers={workers}", "--grace=2",
           "--timeout=1200"]
    env = dict(os.environ)
    if lost_step is None:
        cmd += ["--", sys.executable, *train]
    else:
        cmd += [f"--min_workers={workers - 1}", "--max_restarts=3", "--lost_after=2", "--",
                sys.executable, "-c", WRAPPER, *train]
        env.update(TFPAR_INJECT_FAULTS=f"{workers - 1}:{lost_step}",
                   LOST_SLOT=str(workers - 1))
    began = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - began
    if proc.returncode:
        raise SystemExit(f"job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(metrics_path) as f:
        metrics = json.load(f)
    row = {"workers": workers, "lost_at_step": lost_step, "seconds": wall,
           "final_loss": metrics["final_loss"], "elastic": metrics.get("elastic", [])}
    resumed = re.search(r"training resumed at step (\d+) on (\d+) workers, ([\d.]+) s after",
                        proc.stderr)
    if lost_step is not None:
        if not resumed:
            raise SystemExit(f"no resume line:\n{proc.stderr[-3000:]}")
        row.update(resumed_at_step=int(resumed.group(1)), final_workers=int(resumed.group(2)),
                   steps_repeated=lost_step - int(resumed.group(1)),
                   resume_seconds=float(resumed.group(3)))
    return row


def main_elastic(args):
    rng = random.Random(args.seed)
    work = os.path.join(ROOT, "runs", "bench_elastic")
    os.makedirs(work, exist_ok=True)
    rows = []
    for workers in (4, 2):
        lost = rng.randrange(args.checkpoint_every + 1, args.steps - 2 * args.checkpoint_every)
        hit, whole = run_elastic(args, workers, lost, work), run_elastic(args, workers, None,
                                                                         work)
        hit["uninterrupted_final_loss"] = whole["final_loss"]
        hit["uninterrupted_seconds"] = whole["seconds"]
        hit["loss_gap"] = abs(hit["final_loss"] - whole["final_loss"]) / whole["final_loss"]
        rows.append(hit)
    print(f"{'workers':<9}{'lost at':>8}{'resumed at':>11}{'repeated':>9}{'resume s':>9}"
          f"{'final loss':>11}{'uninterrupted':>14}{'gap':>8}{'wall s':>8}")
    for r in rows:
        print(f"{r['workers']} -> {r['final_workers']:<4}{r['lost_at_step']:>8}"
              f"{r['resumed_at_step']:>11}{r['steps_repeated']:>9}{r['resume_seconds']:>9.1f}"
              f"{r['final_loss']:>11.5f}{r['uninterrupted_final_loss']:>14.5f}"
              f"{r['loss_gap']:>8.3%}{r['seconds']:>8.1f}")
    out = args.out or os.path.join(ROOT, "runs", "bench_elastic.json")
    with open(out, "w") as f:
        json.dump({"seed": args.seed, "steps": args.steps,
                   "checkpoint_every": args.checkpoint_every, "model": args.model,
                   "rows": rows}, f, indent=1)
    print(f"seed {args.seed}, {args.steps} steps, a checkpoint every {args.checkpoint_every}; "
          f"wrote {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--faults", type=int, default=3)
    parser.add_argument("--checkpoint_every", type=int, default=25)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--elastic", action="store_true",
                        help="a worker lost for good: 4 -> 3 and 2 -> 1 workers")
    parser.add_argument("--seed", type=int, default=None,
                        help="--elastic: seed of the step the worker is lost at")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.elastic:
        if args.seed is None:
            args.seed = random.SystemRandom().randrange(1 << 20)
        if args.steps == 300:
            args.steps, args.checkpoint_every = 200, 20
        return main_elastic(args)
    args.out = args.out or os.path.join(ROOT, "runs", "bench_faults.json")
    if args.quick:
        args.steps, args.faults, args.checkpoint_every = 60, 1, 10
    # Spread the kills over the run, off the checkpoint grid so some steps are lost.
    plan = [(k % 2, (k + 1) * args.steps // (args.faults + 1) + 3) for k in range(args.faults)]
    work = os.path.join(ROOT, "runs", "bench_faults")
    os.makedirs(work, exist_ok=True)
    results = {}
    for name, faults in (("no faults", []), ("faults", plan)):
        ckpt = os.path.join(work, f"ckpt_{len(faults)}_{os.getpid()}")
        metrics_path = os.path.join(work, f"metrics_{len(faults)}.json")
        total, events = run_job(args, faults, metrics_path, ckpt)
        with open(metrics_path) as f:
            metrics = json.load(f)
        kills = [(t, s) for t, kind, s in events if kind == "kill"]
        resumes = [s for _, kind, s in events if kind == "resume"]
        recover = []
        for t_kill, _ in kills:
            ready = [t for t, kind, _ in events if kind == "ready" and t > t_kill]
            recover.append(ready[1] - t_kill if len(ready) >= 2 else None)  # both workers
        lost = [step - resumed for (_, step), resumed in zip(kills, resumes[::2])]
        results[name] = {"seconds": total, "faults_injected": len(faults),
                         "faults_survived": len(kills),  # the job finished: every kill was survived
                         "steps_lost": lost, "recover_seconds": recover,
                         "final_loss": metrics["final_loss"], "metrics": metrics}
    base, hit = results["no faults"], results["faults"]
    print(f"{'run':<11}{'faults':>7}{'survived':>9}{'steps lost':>16}{'recover s':>18}"
          f"{'wall s':>8}{'final loss':>11}")
    for name, r in results.items():
        print(f"{name:<11}{r['faults_injected']:>7}{r['faults_survived']:>9}"
              f"{str(r['steps_lost']):>16}{str([round(x or 0, 1) for x in r['recover_seconds']]):>18}"
              f"{r['seconds']:>8.1f}{r['final_loss']:>11.4f}")
    print(f"same final loss: {abs(base['final_loss'] - hit['final_loss']) < 1e-6}; "
          f"extra wall time per fault: "
          f"{(hit['seconds'] - base['seconds']) / max(1, args.faults):.1f} s")
    with open(args.out, "w") as f:
        json.dump({"plan": plan, "checkpoint_every": args.checkpoint_every, **results}, f,
                  indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
