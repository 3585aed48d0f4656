"""Tensor-parallel benchmark: the transformer on 1, 2 and 4 devices of the `model` axis,
and on data_parallel=2 × tensor_parallel=2 with the batch-axis gradient reduction plain
(DTensor's own) or through each `--compression` codec (`tfpar.layout.reduction`), side by
side with the plain single-device Keras step.

    python tools/bench_tensor_parallel.py --json=/tmp/tp.json
    python tools/bench_tensor_parallel.py --quick      # a smoke run, about a minute

Per configuration: step time (median, p90, fastest) of the exact DTensor step (Adam),
taking turns between configurations so load from other processes falls on all alike;
memory per device measured from the shards each device holds: weights and optimizer
state (Adam's two slots), in MB; the process's peak RSS (on CPU all logical devices share
one process, so it is a sum over devices).

Output: a table, and with --json a file {"benchmark": "tensor_parallel", "runs": [...]}
whose runs have the metrics-JSON shape of `tfpar.metrics` (config, strategy, replicas, steps,
final_loss, examples_per_sec, step_time_ms, memory) plus `mesh` and `state_mb_per_device`.
"""

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_list("tensor_parallel", ["1", "2", "4"], "model-axis sizes to try")
flags.DEFINE_list("compression", ["plain", "none", "fp16", "int8"],
                  "batch-axis reductions to try on the 2×2 mesh (plain: DTensor's own; "
                  "empty: no 2×2 rows)")
flags.DEFINE_integer("width", 256, "transformer width")
flags.DEFINE_integer("depth", 4, "transformer blocks")
flags.DEFINE_integer("vocab", 255, "vocabulary of the reversal task (+1 separator)")
flags.DEFINE_integer("batch", 32, "global batch size")
flags.DEFINE_integer("steps", 10, "timed steps per configuration (after one warm-up)")
flags.DEFINE_bool("quick", False, "smoke run: width 64, depth 2, 3 steps")
flags.DEFINE_string("json", "", "write the results here")


def _state_mb(layout, variables):
    per_device = layout.shard_sizes(variables)
    return [round(4 * n / 2**20, 3) for n in per_device]


def main(argv):
    del argv
    if FLAGS.quick:
        FLAGS.width, FLAGS.depth, FLAGS.steps, FLAGS.vocab = 64, 2, 3, 63
    tps = [int(t) for t in FLAGS.tensor_parallel]
    from tfpar import devices
    devices.split_cpu(max(tps + ([4] if FLAGS.compression else [])))
    import keras
    import tensorflow as tf
    from tfpar import models
    from tfpar import ParallelConfig, data, layout, metrics

    task = data.reverse_task(0, vocab=FLAGS.vocab)
    config = ParallelConfig(model="transformer", global_batch_size=FLAGS.batch,
                            model_width=FLAGS.width, model_depth=FLAGS.depth)
    batches = data.global_batches(config, task, 0, FLAGS.steps + 1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build_model():
        keras.utils.set_random_seed(0)
        return models.transformer(task.input_shape, task.num_classes, width=FLAGS.width,
                                  depth=FLAGS.depth)

    runs = []  # (name, step(batch) -> loss, record)
    plain, plain_opt = build_model(), keras.optimizers.Adam(1e-3)

    @tf.function
    def plain_step(x, y, w):
        with tf.GradientTape() as tape:
            value = loss(y, plain(x, training=True), w)
        grads = [tf.convert_to_tensor(g)
                 for g in tape.gradient(value, plain.trainable_variables)]
        plain_opt.apply(grads, plain.trainable_variables)
        return value

    plain_opt.build(plain.trainable_variables)
    params = plain.count_params()
    runs.append(("plain 1 device", lambda b: float(plain_step(*b)), {
        "strategy": "OneDevice (plain Keras)", "mesh": [1, 1],
        "params_per_device": [params],
        "state_mb_per_device": [round(4 * 3 * params / 2**20, 3)]}))
    for tp in tps:
        mesh = layout.make_mesh(1, tp, devices.compute_devices()[:tp])
        model, trainer = layout.build_on_mesh(
            mesh, layout.preset_rules(layout.model_presets("transformer")), build_model,
            lambda: keras.optimizers.Adam(1e-3), loss)
        runs.append((f"mesh 1x{tp}", lambda b, t=trainer: t.train_on_batch(*b)["loss"], {
            "strategy": "DTensorMesh", "mesh": [1, tp],
            "params_per_device": layout.shard_sizes(model.weights),
            "state_mb_per_device": _state_mb(
                layout, list(model.weights) + list(trainer.optimizer.variables))}))

    for codec in FLAGS.compression:
        mesh = layout.make_mesh(2, 2, devices.compute_devices()[:4])
        model, trainer = layout.build_on_mesh(
            mesh, layout.preset_rules(layout.model_presets("transformer")), build_model,
            lambda: keras.optimizers.Adam(1e-3), loss,
            compression=None if codec == "plain" else codec)
        runs.append((f"mesh 2x2 {codec}", lambda b, t=trainer: t.train_on_batch(*b)["loss"], {
            "strategy": "DTensorMesh", "mesh": [2, 2], "compression": codec,
            "params_per_device": layout.shard_sizes(model.weights),
            "state_mb_per_device": _state_mb(
                layout, list(model.weights) + list(trainer.optimizer.variables)
                ),
            "residual_mb_per_device": _state_mb(layout, trainer.reduction.variables)
            if trainer.reduction is not None else None}))

    times = {name: [] for name, _, _ in runs}
    losses = {name: [] for name, _, _ in runs}
    for name, step, _ in runs:
        losses[name].append(step(batches[0]))  # trace and warm up
    for batch in batches[1:]:
        for name, step, _ in runs:
            t0 = time.perf_counter()
            losses[name].append(step(batch))
            times[name].append(time.perf_counter() - t0)

    results = []
    print(f"transformer width={FLAGS.width} depth={FLAGS.depth} vocab={task.num_classes} "
          f"batch={FLAGS.batch}, {params} parameters, Adam; {FLAGS.steps} timed steps")
    print(f"{'run':<20}{'step ms (med/p90/min)':>24}{'params/device':>15}"
          f"{'weights+Adam MB/device':>24}")
    for name, _, record in runs:
        ms = sorted(1e3 * t for t in times[name])
        step_ms = {"median": statistics.median(ms),
                   "p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))], "min": ms[0]}
        result = {"config": {**config.to_dict(), "data_parallel": record["mesh"][0],
                             "tensor_parallel": record["mesh"][1],
                             "compression": record.get("compression", "none")},
                  "strategy": record["strategy"], "replicas": record["mesh"][0],
                  "workers": 1, "residual_mb_per_device": record.get("residual_mb_per_device"),
                  "steps": len(losses[name]), "final_loss": losses[name][-1],
                  "loss_history": losses[name],
                  "examples_per_sec": FLAGS.batch / (step_ms["median"] / 1e3),
                  "step_time_ms": step_ms, "mesh": record["mesh"],
                  "state_mb_per_device": record["state_mb_per_device"],
                  "memory": {"peak_rss_mb": metrics.peak_rss_mb(),
                             "params_per_device": record["params_per_device"]}}
        results.append(result)
        print(f"{name:<20}{step_ms['median']:>10.1f} /{step_ms['p90']:>6.1f} /"
              f"{step_ms['min']:>6.1f}{record['params_per_device'][0]:>15}"
              f"{record['state_mb_per_device'][0]:>24.2f}")
    print(f"peak RSS of the process (all devices): {metrics.peak_rss_mb():.0f} MB")
    if FLAGS.json:
        metrics.write_json(FLAGS.json, {"benchmark": "tensor_parallel", "runs": results})


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here or in any child (they inherit it).
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    app.run(main)
