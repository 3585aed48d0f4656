"""Injected worker deaths over a 2-worker run: faults survived, steps lost, time to recover.

A fault-free run and a run with `--faults` SIGKILLs (alternating workers, spread over the
run, via `TFPAR_INJECT_FAULTS`) under `tfpar.launch --max_restarts`, side by side. Steps lost
are read from the resumed runs' logs ("resuming ... at step S"); time to recover is from a
kill to the restarted workers being ready again (strategy built, checkpoint next).

    python tools/bench_faults.py                 # 3 faults over 300 steps
    python tools/bench_faults.py --quick         # 1 fault over 60 steps

Prints a table and writes JSON (`--out`, default runs/bench_faults.json).
"""

import argparse
import json
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--faults", type=int, default=3)
    parser.add_argument("--checkpoint_every", type=int, default=25)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_faults.json"))
    args = parser.parse_args()
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
