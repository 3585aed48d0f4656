"""tfpar's data-parallel `fit` against plain `tf.distribute` + Keras `fit`, side by side.

Both train the same model on the same data on the same `MirroredStrategy`. Each bench
process builds the strategy once and then alternates rounds: a plain run (what a user
writes without tfpar: build, compile, `fit`) and a tfpar run (`tfpar.train.train` on that
strategy, so tfpar's whole path: optimizer hooks, callbacks, data), which side goes first
alternating. Comparing rounds of one process removes what differs between processes
(measured here: ~15 % from one process to the next on the same command, larger than the
effect asked about). `--processes` processes repeat the whole thing.

    python tools/bench_data_parallel.py                  # mlp + transformer, 4 logical CPUs
    python tools/bench_data_parallel.py --quick          # a smoke run in about a minute

The overhead is the median over all rounds of (tfpar's median step time / the plain
median step time of the same round) - 1. Prints a table and writes JSON (`--out`, default
runs/bench_data_parallel.json): per model the last tfpar and plain metrics (DESIGN.md
shape), every round's median step times, and `overhead`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {"mlp": {"model_width": 1024, "global_batch_size": 256},
          "transformer": {"global_batch_size": 64}}


def run_plain(config, runtime):
    """What a user would write without tfpar: compile and fit under the strategy."""
    import keras

    from tfpar import models
    from tfpar import data, metrics

    keras.utils.set_random_seed(config.seed)
    task = data.make_task(config)
    with runtime.strategy.scope():
        model = models.build(config.model, task.input_shape, task.num_classes,
                             width=config.model_width)
        model.compile(optimizer=keras.optimizers.Adam(config.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      jit_compile=False)
    dataset = data.distributed_dataset(runtime.strategy, config, task)
    recorder = metrics.StepRecorder()
    model.fit(dataset, epochs=1, steps_per_epoch=config.steps, callbacks=[recorder],
              verbose=0)
    return metrics.summarize(config, runtime, recorder,
                             [model.count_params()] * runtime.replicas)


def run_tfpar(config, runtime):
    from tfpar.train import train

    return train(config, runtime=runtime)[0]


def bench_process(settings, rounds):
    """One process: the strategy once, then `rounds` alternating plain/tfpar rounds."""
    from tfpar import devices, strategy
    from tfpar.config import ParallelConfig

    config = ParallelConfig(**settings)
    devices.split_cpu(config.cpu_devices)
    runtime = strategy.make_runtime(config)  # tfpar builds MirroredStrategy(devices) here
    sides = {"plain": run_plain, "tfpar": run_tfpar}
    out = {"plain": [], "tfpar": []}
    for r in range(rounds):
        for role in (("plain", "tfpar") if r % 2 == 0 else ("tfpar", "plain")):
            out[role].append(sides[role](config, runtime))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per process")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--cpu_devices", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="20 steps, 2 rounds, mlp only")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_data_parallel.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(bench_process(json.loads(args.child), args.rounds)))
        return
    if args.quick:
        args.models, args.steps, args.rounds, args.processes = "mlp", 20, 2, 1

    report, rows = {}, []
    for name in args.models.split(","):
        settings = {"model": name, "steps": args.steps, "steps_per_epoch": args.steps,
                    "cpu_devices": args.cpu_devices, "strategy": "mirrored", "verbose": 0,
                    **MODELS[name]}
        rounds = {"plain": [], "tfpar": []}
        for _ in range(args.processes):
            out = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(settings),
                 f"--rounds={args.rounds}"],
                capture_output=True, text=True, timeout=1800, cwd=ROOT)
            if out.returncode:
                raise SystemExit(f"bench process failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            for role in rounds:
                rounds[role] += result[role]
        per_round = {role: [r["step_time_ms"]["median"] for r in rs] for role, rs in rounds.items()}
        ratios = [t / p for t, p in zip(per_round["tfpar"], per_round["plain"])]
        overhead = statistics.median(ratios) - 1
        median = {role: statistics.median(ms) for role, ms in per_round.items()}
        report[name] = {"plain": rounds["plain"][-1], "tfpar": rounds["tfpar"][-1],
                        "step_ms_per_round": per_round, "step_ms": median,
                        "ratio_per_round": ratios, "overhead": overhead,
                        "rounds": len(ratios)}
        rows.append((name, median["plain"], median["tfpar"], overhead, min(ratios) - 1,
                     max(ratios) - 1, len(ratios)))

    print(f"{'model':<12}{'plain ms/step':>15}{'tfpar ms/step':>15}{'overhead':>10}"
          f"{'rounds: min':>13}{'max':>8}{'n':>4}")
    for name, plain, ours, overhead, low, high, n in rows:
        print(f"{name:<12}{plain:>15.2f}{ours:>15.2f}{overhead:>+10.1%}{low:>+13.1%}"
              f"{high:>+8.1%}{n:>4}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
