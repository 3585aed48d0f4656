"""tfpar's data-parallel `fit` against plain `tf.distribute` + Keras `fit`, side by side.

Both train the same model on the same data with the same strategy; each run is its own
process (one strategy per process) and the two alternate, `--repeats` times each, so slow
drift of a noisy machine hits both alike. The overhead is the ratio of median step times.

    python tools/bench_data_parallel.py                  # mlp + transformer, 4 logical CPUs
    python tools/bench_data_parallel.py --quick          # a smoke run in about a minute

Prints a table and writes JSON (`--out`, default runs/bench_data_parallel.json): per model
the tfpar and plain metrics (DESIGN.md shape), every run's median step time, `overhead` =
median over runs of tfpar / plain - 1, and `overhead_fastest` from each side's fastest run.
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


def run_plain(settings):
    """What a user would write without tfpar: MirroredStrategy, compile, fit."""
    import keras
    import tensorflow as tf

    import models
    from tfpar import data, devices, metrics
    from tfpar.config import ParallelConfig

    config = ParallelConfig(**settings)
    devices.split_cpu(config.cpu_devices)
    keras.utils.set_random_seed(config.seed)
    strategy = tf.distribute.MirroredStrategy(devices.compute_devices())
    task = data.make_task(config)
    with strategy.scope():
        model = models.build(config.model, task.input_shape, task.num_classes,
                             width=config.model_width)
        model.compile(optimizer=keras.optimizers.Adam(config.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      jit_compile=False)
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: data.pipeline_dataset(config, task, ctx))
    recorder = metrics.StepRecorder()
    model.fit(dataset, epochs=1, steps_per_epoch=config.steps, callbacks=[recorder],
              verbose=0)
    runtime = type("Runtime", (), {"strategy": strategy, "replicas": 4, "workers": 1})
    return metrics.summarize(config, runtime, recorder, [model.count_params()] * 4)


def run_tfpar(settings):
    from tfpar.config import ParallelConfig
    from tfpar.train import train

    result, _ = train(ParallelConfig(**settings))
    return result


def child(role, settings):
    out = subprocess.run([sys.executable, __file__, "--child", role, json.dumps(settings)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{role} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu_devices", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="30 steps, 1 repeat, mlp only")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_data_parallel.json"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        role, settings = args.child[0], json.loads(args.child[1])
        result = (run_plain if role == "plain" else run_tfpar)(settings)
        print(json.dumps(result))
        return
    if args.quick:
        args.models, args.steps, args.repeats = "mlp", 30, 1

    report = {}
    rows = []
    for name in args.models.split(","):
        settings = {"model": name, "steps": args.steps, "steps_per_epoch": args.steps,
                    "cpu_devices": args.cpu_devices, "strategy": "mirrored", "verbose": 0,
                    **MODELS[name]}
        runs = {"plain": [], "tfpar": []}
        for repeat in range(args.repeats):
            # Alternate which goes first, so neither gains from the other's warm caches.
            for role in (("plain", "tfpar") if repeat % 2 == 0 else ("tfpar", "plain")):
                runs[role].append(child(role, settings))
        per_run = {role: [r["step_time_ms"]["median"] for r in rs] for role, rs in runs.items()}
        median = {role: statistics.median(ms) for role, ms in per_run.items()}
        # The fastest run of each is the least disturbed by the rest of the machine.
        best = {role: min(ms) for role, ms in per_run.items()}
        overhead = median["tfpar"] / median["plain"] - 1
        overhead_best = best["tfpar"] / best["plain"] - 1
        report[name] = {"plain": runs["plain"][-1], "tfpar": runs["tfpar"][-1],
                        "step_ms_per_run": per_run, "step_ms": median, "overhead": overhead,
                        "overhead_fastest": overhead_best}
        rows.append((name, median["plain"], median["tfpar"], overhead, overhead_best,
                     runs["tfpar"][-1]["final_loss"], runs["plain"][-1]["final_loss"]))

    print(f"{'model':<12}{'plain ms/step':>15}{'tfpar ms/step':>15}{'overhead':>10}"
          f"{'(fastest)':>11}{'loss tfpar':>12}{'loss plain':>12}")
    for name, plain, ours, overhead, overhead_best, loss_t, loss_p in rows:
        print(f"{name:<12}{plain:>15.2f}{ours:>15.2f}{overhead:>+10.1%}{overhead_best:>+11.1%}"
              f"{loss_t:>12.4f}{loss_p:>12.4f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
