"""How much of the gradient exchange hides behind backward, inside one traced step: two
workers on a shaped link.

Two `MultiWorkerMirroredStrategy` workers (tools/shaped_link.py, needs root) build the
trainer's multi-worker `--compression=none` model (fp32 sums in `--bucket_mb` buckets, last
layers first) and run `tfpar.compression.timing.measure_comm_fraction`: its timeline step
(forward, backward, the buckets' all-reduces) carries in-step timestamps, gathered from
both workers after each step. Per step it prints when backward ended and when each
all-reduce was busy (from the step's start), and the share of the busy time before
backward's end (`hidden_fraction`, the metrics JSON's `comm.hidden_fraction`); then the
medians, with the separately timed calls (`compute`: forward + backward alone,
`aggregate`: the sums alone) that say whether the run is communication-bound.

`--model=conv_head` is not in the zoo: two 3x3 convolutions of `--width` channels over
the convnet task's 16x16 images, a dense layer of `--hidden` units over them, logits. Its
first layers hold the computation and its last the parameters (as a CNN with a dense
head), so the head's bucket is ready right after forward; `--recompute=full` makes
backward 3/4 of the computation.

    python tools/profile_overlap.py --model=conv_head --batch=128 --recompute=full
    python tools/profile_overlap.py --model=mlp --width=256 --depth=8 --batch=2048
"""

import argparse
import json
import os
import sys
import tempfile

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))  # tfpar, from a checkout
PORT = 23529


def conv_head(config, runtime, task, channels, hidden):
    """The `--model=conv_head` model, compiled with the trainer's optimizer bucketed as
    across workers (and `config.recompute` applied)."""
    import keras

    from tfpar import optimizers, recompute

    with runtime.strategy.scope():
        inputs = keras.Input(task.input_shape)
        x = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(inputs)
        x = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(x)
        x = keras.layers.Dense(hidden, activation="relu")(keras.layers.Flatten()(x))
        model = keras.Model(inputs, keras.layers.Dense(task.num_classes)(x))
        recompute.apply(model, config)
        model.compile(optimizer=optimizers.make_optimizer(config, bucketed=True),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
    return model


def build(settings):
    """`(config, runtime, task, model)` for a worker: `settings` are `ParallelConfig`
    fields, plus `conv_head: [channels, hidden]` for that model."""
    from tfpar import ParallelConfig, data
    from tfpar.backends.distribute import DistributeBackend

    settings = dict(settings)
    head = settings.pop("conv_head", None)
    config = ParallelConfig(strategy="multi_worker", optimizer="sgd", verbose=0,
                            **{"model": "convnet" if head else "mlp", **settings})
    backend = DistributeBackend()
    runtime = backend.build_runtime(config)
    task = data.make_task(config)
    model = (conv_head(config, runtime, task, *head) if head
             else backend.build_model(config, runtime, task))
    return config, runtime, task, model


def measure(settings, steps):
    """`measure_comm_fraction`'s figures for `settings` on this worker."""
    from tfpar import data
    from tfpar.compression.timing import measure_comm_fraction

    config, runtime, task, model = build(settings)
    _, times = measure_comm_fraction(
        runtime.strategy, model, data.distributed_dataset(runtime.strategy, config, task),
        steps=steps)
    return times


def settings_of(args):
    settings = {"global_batch_size": args.batch, "bucket_mb": args.bucket_mb,
                "recompute": args.recompute, "seed": 0}
    if args.model == "conv_head":
        settings["conv_head"] = [args.width, args.hidden]
    else:
        settings.update(model_width=args.width, model_depth=args.depth)
    return settings


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rounds = [measure(settings_of(args), args.steps)]
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        with open(args.worker, "w") as f:
            json.dump({"settings": settings_of(args), "rate": args.rate, "rounds": rounds}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate of each direction")
    parser.add_argument("--model", choices=("conv_head", "mlp"), default="conv_head")
    parser.add_argument("--width", type=int, default=32,
                        help="conv_head: channels; mlp: units")
    parser.add_argument("--hidden", type=int, default=64, help="conv_head: the dense units")
    parser.add_argument("--depth", type=int, default=8, help="mlp: layers")
    parser.add_argument("--batch", type=int, default=128, help="global batch (2 workers)")
    parser.add_argument("--bucket_mb", type=float, default=0.25)
    parser.add_argument("--recompute", default="full", help="the trainer's --recompute")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each kind")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for both workers")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the JSON file worker 0 writes
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, TOOLS)
    from shaped_link import ShapedLink

    with tempfile.TemporaryDirectory() as folder, ShapedLink(rate=args.rate) as link:
        out = os.path.join(folder, "rounds.json")
        codes, log = link.run_workers([sys.executable, os.path.abspath(__file__),
                                       *sys.argv[1:], f"--worker={out}"], PORT, args.timeout)
        if any(codes):
            print(f"profile_overlap: workers exited {codes}\n{log}", file=sys.stderr)
            return 1
        with open(out) as f:
            result = json.load(f)
    for times in result["rounds"]:
        for step in times.get("timeline_ms", []):
            print(f"backward ends {step['backward_end']:7.1f} ms | all-reduces busy "
                  + ", ".join(f"{b:.0f}-{e:.0f}" for b, e in step["collectives"]) + " ms")
        print(f"median: hidden {times.get('hidden_fraction', float('nan')):.2f} of "
              f"{times.get('comm_busy_ms', float('nan')):.0f} ms busy, backward ends "
              f"{times.get('backward_end_ms', float('nan')):.0f} ms | alone: forward + "
              f"backward {times['compute_ms']:.0f} ms, sums {times['aggregate_ms']:.0f} ms, "
              f"both {times['step_ms']:.0f} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
