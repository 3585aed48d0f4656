"""When each bucket's all-reduce ends, against when backward ends: two workers on a shaped link.

Two `MultiWorkerMirroredStrategy` workers (tools/shaped_link.py, needs root) run the same
MLP. Each round times two traced steps from one `tf.timestamp()` at their start:

- `backward`: forward + backward alone, timed by the wall clock around the call (an
  in-graph timestamp after the gradients ran at once: a stateful op in a `tf.function`
  is ordered only against other stateful ops, and the gradient ops are not);
- `buckets` (or `one pack`): forward + backward + the fp32 sum over the workers, one
  all-reduce per layer, last layer first (or one for all), a timestamp as each sum arrives.

Timestamps are stateful ops, which a `tf.function` runs in program order, so the two are
timed in separate steps: in one, a timestamp after backward would hold back every later
one. A bucket that ends before backward's end crossed the link while backward ran.

    python tools/profile_overlap.py --rate=100mbit --width=256 --depth=8 --batch=4096
"""

import argparse
import json
import os
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
PORT = 23529


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((args.width,))]
            + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth)]
            + [keras.layers.Dense(10)])
    x = tf.constant(np.random.RandomState(0).randn(args.batch // 2, args.width)
                    .astype("float32"))
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=0)

    def step(mode):
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
        if mode == "backward":
            return tf.add_n([tf.reduce_sum(g) for g in grads])[None]
        ctx = tf.distribute.get_replica_context()
        pairs = [grads[k:k + 2] for k in range(len(grads) - 2, -1, -2)]  # last layer first
        if mode == "one pack":
            pairs = [grads]
        ends = []
        for pair in pairs:
            total = ctx.all_reduce("SUM", tf.concat([tf.reshape(g, [-1]) for g in pair], 0),
                                   options=options)
            with tf.control_dependencies([total]):
                ends.append(tf.timestamp() - start)
        return tf.stack(ends)

    fns = {mode: tf.function(lambda mode=mode: strategy.run(step, args=(mode,)))
           for mode in ("backward", "buckets", "one pack")}
    rounds = []
    for i in range(args.rounds + 1):  # alternating; the first round traces
        ms = {}
        for mode, fn in fns.items():
            began = time.perf_counter()
            values = strategy.experimental_local_results(fn())[0].numpy()
            ms[mode] = ([round(1000 * (time.perf_counter() - began), 1)] if mode == "backward"
                        else [round(1000 * float(t), 1) for t in values])
        if i:
            rounds.append(ms)
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        with open(args.worker, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "worker"},
                       "rounds_ms": rounds}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate of each direction")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096, help="global batch (2 workers)")
    parser.add_argument("--rounds", type=int, default=4)
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
    for r in result["rounds_ms"]:
        print(f"backward ends {r['backward'][0]:7.1f} ms | buckets end "
              f"{', '.join(f'{t:.0f}' for t in r['buckets'])} ms | one pack ends "
              f"{r['one pack'][0]:.0f} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
