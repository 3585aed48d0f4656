"""Where device memory goes in an offloaded step (`--offload=optimizer`): the allocator's
peak of the step's pieces, each run alone on the trainer's model and replicas.

    python tools/profile_offload_memory.py --width=512 --depth=6

Builds the run `python -m tfpar.train --model=transformer --model_width=W --model_depth=D
--cpu_devices=2 --global_batch_size=8 --optimizer=adam --offload=optimizer
--strategy=mirrored` would build (the trainer's own runtime and model code), uncapped, then
runs each of these on one fixed batch in its own `tf.function`, resetting the allocator's
peak before each, and prints the peak above what was allocated before it (MB, the whole
process: the logical CPUs share one allocator, `tfpar.memory`):

    weights             what is allocated after building (every replica's weights; the
                        slots are on the host), before any step
    forward             the loss alone
    backward, streamed  forward + backward, each gradient reduced to a scalar as it is
                        produced (what the backward pass itself holds at once)
    backward, kept      forward + backward, every gradient returned (the whole gradient
                        set of every replica alive at the end)
    + all-reduce        forward + backward + Keras's all-reduce of every gradient (the
                        device-resident run's and the old offloaded step's reduction)
    offloaded step      Keras's `train_step` with the offloaded update (a full step)

The ladder's parameter count (12 x width^2 x depth) and one replica's gradient set in MB
are printed for scale. Memory figures do not depend on the machine's load.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--offload", default="optimizer", help="optimizer or none")
    parser.add_argument("--json", default="", help="also write the figures here")
    args = parser.parse_args()

    from tfpar import ParallelConfig, cpu_kernels
    from tfpar.memory import ALLOCATOR_ENV
    os.environ[ALLOCATOR_ENV] = "true"  # before TensorFlow: the allocator's figures
    cpu_kernels.select("auto")
    import tensorflow as tf

    from tfpar import backends, data

    config = ParallelConfig(model="transformer", model_width=args.width,
                            model_depth=args.depth, cpu_devices=args.devices,
                            global_batch_size=args.batch, optimizer="adam",
                            offload=args.offload, strategy="mirrored", steps=1)
    backend = backends.for_config(config)
    runtime = backend.build_runtime(config)
    strategy = runtime.strategy
    task = data.make_task(config)
    model = backend.build_model(config, runtime, task)
    batch = next(iter(data.distributed_dataset(strategy, config, task)))
    variables = model.trainable_variables
    loss_fn = model.loss

    def mb(n):
        return round(n / 2 ** 20, 1)

    def info():
        return tf.config.experimental.get_memory_info("CPU:0")

    def loss_of(x, y):
        return loss_fn(y, model(x, training=True))

    def forward(x, y, *rest):
        return loss_of(x, y)

    def backward_streamed(x, y, *rest):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        grads = tape.gradient(loss, variables)
        return tf.add_n([tf.reduce_sum(tf.convert_to_tensor(g)) for g in grads])

    def backward_kept(x, y, *rest):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]

    def all_reduced(x, y, *rest):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        grads = tape.gradient(loss, variables)
        reduced = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, grads)
        return tf.add_n([tf.reduce_sum(tf.convert_to_tensor(g)) for g in reduced])

    def summed_per_weight(x, y, *rest):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        grads = tape.gradient(loss, variables)

        def reduce(distribution, *grads):
            device = distribution.extended.worker_devices[0]
            return [tf.reduce_sum(distribution.experimental_local_results(
                distribution.extended.reduce_to(tf.distribute.ReduceOp.SUM, g,
                                                destinations=device))[0])
                    for g in grads if not isinstance(distribution.experimental_local_results(
                        g)[0], tf.IndexedSlices)]
        return tf.add_n(tf.distribute.get_replica_context().merge_call(reduce, args=grads))

    def step(*batch):
        return model.train_step(batch)

    rows = {"weights": mb(info()["current"])}
    for name, fn in (("forward", forward), ("backward, streamed", backward_streamed),
                     ("backward, kept", backward_kept), ("+ all-reduce", all_reduced),
                     ("+ summed per weight", summed_per_weight),
                     ("offloaded step" if args.offload != "none" else "step", step)):
        function = tf.function(lambda b, fn=fn: strategy.run(fn, args=tuple(b)))
        function(batch)  # traced and run once, then measured on a second run
        before = info()["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        out = function(batch)
        rows[name] = mb(info()["peak"] - before)
        del out
    params = 12 * args.width ** 2 * args.depth
    grads_mb = mb(4 * sum(int(v.shape.num_elements()) for v in variables))
    print(f"transformer {args.width}x{args.depth} ({params:,} ladder params; one replica's "
          f"gradients {grads_mb} MB), {args.devices} logical CPUs, batch {args.batch}, "
          f"offload={args.offload}: allocator MB, the process")
    for name, value in rows.items():
        print(f"  {name:<22}{value:>8.1f}" + ("" if name == "weights" else "  (peak above)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"width": args.width, "depth": args.depth, "devices": args.devices,
                       "batch": args.batch, "offload": args.offload,
                       "gradients_mb_per_replica": grads_mb, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
