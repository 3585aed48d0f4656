"""Child process for tests/test_pipeline_training.py:
`python tests/pipeline_runs_child.py CONFIGS_JSON ERRORS CLI_JSON OUT_DIR`.

Trains each `[name, config]` of CONFIGS_JSON one after the other on one runtime per strategy
(`tfpar.train.train(runtime=...)`, as tests/train_runs_child.py does) in 4 logical CPUs, and
prints one JSON line `{name: report}`: losses, final weights, where the stage variables and
optimizer slots live, the pipeline metrics block. With ERRORS = 1 it then also reports,
under "errors", what building the pipeline with settings that do not combine raises, and
under "fp16_overflow" a forced fp16 overflow's skipped step (`fp16_overflow`;
`fp16_overflow_steps` also runs Chimera's, in tests/pipeline_chimera_child.py), under
"nan_skip" a NaN batch skipped by the non-finite guard (`nan_skip`).

With CLI_JSON not `null` (the argv of `python -m tfpar.train`), the runs and that command
line each run in a process forked from this one after its one TensorFlow import
(tests/forking.py), and the line printed is `{"runs": ..., "cli": ...}`, each
`{"returncode", "stdout", "stderr", "seconds"}`.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow  # noqa: E402,F401  (imported once, for both forks)

from tfpar import ParallelConfig, devices, strategy  # noqa: E402
from tfpar import train as T  # noqa: E402

def report(result, model):
    """What the tests check of one run."""
    out = {"loss": result["loss_history"], "replicas": result["replicas"],
           "weights": [np.asarray(w).ravel().tolist() for w in model.weights]}
    if hasattr(model, "stages"):
        parts = lambda v: getattr(v.value, "values", [v.value])
        where = lambda vs: sorted({p.device.split("device:")[-1] for v in vs for p in parts(v)})
        out["stage_devices"] = [where(s.weights) for s in model.stages]
        out["slot_devices"] = [where(o.variables) for o in model.stage_optimizers]
        out["pipeline"] = model.pipeline_metrics()
        out["params_per_stage"] = model.params_per_stage()
        aggregators = [getattr(o, "tfpar_aggregator", None) for o in model.stage_optimizers]
        if all(aggregators):
            # tf.Variables (per-replica residuals, Q), not Keras variables.
            out["aggregator_devices"] = [sorted({p.device.split("device:")[-1]
                                                 for v in a.variables
                                                 for p in getattr(v, "values", [v])})
                                         for a in aggregators]
        # Largest difference between the copies of a mirrored variable (replicas in sync: 0).
        out["replica_spread"] = max(
            [float(np.abs(v.value.values[0].numpy() - v.value.values[r].numpy()).max())
             for v in model.weights if hasattr(v.value, "values")
             for r in range(1, len(v.value.values))] or [0.0])
    out["comm"] = result.get("comm")
    return out


runtimes = {}


def runtime_for(config):
    key = (config.strategy, config.data_parallel, config.pipeline_stages, config.collective)
    if key not in runtimes:
        runtimes[key] = strategy.make_runtime(config)
    return runtimes[key]


def train_runs(configs, errors):
    devices.split_cpu(4)
    out = {}
    for name, settings in configs:
        print(f"run {name}: {settings}", file=sys.stderr, flush=True)
        config = ParallelConfig(**settings)
        out[name] = report(*T.train(config, runtime=runtime_for(config)))
    if errors:
        out["errors"] = refusals()
        out["fp16_overflow"] = fp16_overflow()
        out["nan_skip"] = nan_skip()
    print(json.dumps(out), flush=True)


def refusals():
    from tfpar import models
    import tfpar.pipeline
    from tfpar.errors import TfparError
    base = ParallelConfig(model="mlp", pipeline_stages=2, microbatches=4, cpu_devices=4,
                          data_parallel=2, global_batch_size=16)
    runtime = runtime_for(base)

    def error(**changes):
        # Settings that do not combine are refused by the config itself (tfpar.compat),
        # before the pipeline is built; the rest when it is.
        with runtime.strategy.scope():
            try:
                config = base.replace(**changes)
                tfpar.pipeline.for_training(models.build("mlp", (32,), 10), config, runtime)
            except TfparError as err:
                return f"{type(err).__name__}: {err}"
        return "no error"
    # The generated data pads any split (tests/test_pipeline_uneven_batch.py); a
    # --dataset function's equal per-replica batches must split into micro-batches.
    return {"per_replica": error(microbatches=16, dataset="user_data:sign_of_sum"),
            "devices": error(pipeline_stages=3, microbatches=2)}


def fp16_overflow_steps(schedule, devices=None):
    """A 2-stage fp16 `PipelineModel` (`schedule`, on `devices`) and its unpipelined model
    (same weights) trained on the same three batches, the second holding an input past
    fp16's range. Returns (per step: each model's loss scales, per stage for the pipeline;
    per model whether the step changed its weights; the largest weight difference between
    them, over the first pipeline's stages; for Chimera the largest difference between
    each stage and its copy in the second pipeline), and the `PipelineModel`."""
    import keras
    from pipeline_models import flat
    from tfpar import models, nan_guard, optimizers
    from tfpar.pipeline.model import PipelineModel
    optimizers.set_policy("fp16")
    try:
        keras.utils.set_random_seed(0)
        ref = models.build("mlp", (32,), 10)
        pipe = PipelineModel.split(ref, 2, schedule, 4, devices=devices)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        for m in (ref, pipe):
            m.compile(optimizer=nan_guard.ConsistentLossScaleOptimizer(
                keras.optimizers.SGD(0.1)), loss=loss, jit_compile=False)
        rng = np.random.default_rng(0)
        batches = [(rng.normal(size=(16, 32)).astype("float32"), rng.integers(0, 10, 16))
                   for _ in range(3)]
        batches[1][0][3, 5] = 1e5  # inf in float16 (max 65504): gradients not finite
        K = len(pipe.devices)
        firsts, copies = pipe.stages[:K], pipe.stages[:K - 1:-1]  # copy K + s: stage K-1-s
        steps = []
        for x, y in batches:
            before = {"ref": flat([ref]), "pipe": flat(firsts)}
            ref.train_on_batch(x, y)
            pipe.train_on_batch(x, y)
            after = {"ref": flat([ref]), "pipe": flat(firsts)}
            step = {"scales": {"ref": [float(ref.optimizer.dynamic_scale.numpy())],
                               "pipe": [float(o.dynamic_scale.numpy())
                                        for o in pipe.stage_optimizers]},
                    "changed": {k: bool(np.any(before[k] != after[k])) for k in before},
                    "max_diff": float(np.abs(after["ref"] - after["pipe"]).max())}
            if copies:
                step["copies"] = float(np.abs(after["pipe"] - flat(copies)).max())
            steps.append(step)
        return steps, pipe
    finally:
        optimizers.set_policy("none")


def fp16_overflow():
    """`fp16_overflow_steps` with 1F1B; then the executor's agreement alone: a finite
    stage beside a non-finite one is made non-finite too."""
    import tensorflow as tf
    steps, pipe = fp16_overflow_steps("1f1b")
    agreed = pipe._executor._agree_on_finite([[tf.ones(2)], [tf.constant([1.0, np.inf])]])
    finite = [[bool(tf.reduce_all(tf.math.is_finite(g))) for g in gs] for gs in agreed]
    kept = pipe._executor._agree_on_finite([[tf.ones(2)], [tf.ones(3)]])
    return {"steps": steps, "agreed_finite": finite,
            "kept": [[np.asarray(g).tolist() for g in gs] for gs in kept]}


def nan_skip():
    """A 2-stage float32 `PipelineModel` whose optimizer skips non-finite steps
    (`--on_nan=skip_step`'s guard) on three batches, the second with a NaN: per step,
    whether each stage's weights changed, each stage's count of skipped steps, and the
    steps `NaNGuard` reports skipped."""
    import keras
    from tfpar import models, nan_guard
    from tfpar.pipeline.model import PipelineModel
    keras.utils.set_random_seed(0)
    pipe = PipelineModel.split(models.build("mlp", (32,), 10), 2, "1f1b", 4)
    optimizer = nan_guard.skip_nonfinite_updates(keras.optimizers.SGD(0.1), skip=True)
    pipe.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=False)
    guard = nan_guard.NaNGuard("skip_step")
    guard.set_model(pipe)
    guard.on_train_begin()
    rng = np.random.default_rng(1)
    steps = []
    for i in range(3):
        x, y = rng.normal(size=(16, 32)).astype("float32"), rng.integers(0, 10, 16)
        if i == 1:
            x[3, 5] = np.nan
        before = [[np.asarray(w).copy() for w in s.weights] for s in pipe.stages]
        loss = pipe.train_on_batch(x, y)
        guard.on_train_batch_end(i, {"loss": float(np.ravel(loss)[0])})
        steps.append({"changed": [any(bool(np.any(b != np.asarray(w)))
                                      for b, w in zip(bs, s.weights))
                                  for bs, s in zip(before, pipe.stages)],
                      "counted": [float(o.nonfinite_steps.numpy())
                                  for o in pipe.stage_optimizers]})
    return {"steps": steps, "skipped": guard.skipped}


def command_line(argv):
    sys.argv = ["tfpar.train"] + argv
    T.run()


def main():
    configs, errors = json.loads(sys.argv[1]), sys.argv[2] == "1"
    cli, folder = json.loads(sys.argv[3]), sys.argv[4]
    if cli is None:
        train_runs(configs, errors)
        return
    # Each fork splits the CPU its own way and starts its own runtime.
    from forking import run_forked
    runs_done, cli_done = run_forked([lambda: train_runs(configs, errors),
                                      lambda: command_line(cli)], folder)
    print(json.dumps({"runs": runs_done, "cli": cli_done}), flush=True)


if __name__ == "__main__":
    main()
