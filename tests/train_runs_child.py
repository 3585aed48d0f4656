"""Child process for tests: `python tests/train_runs_child.py RUNS_JSON OUT_PREFIX`.

Trains several configs one after the other in one process, each as `tests/train_child.py`
trains one: RUNS_JSON is a list of `[name, config]`. Starting TensorFlow and a strategy
costs seconds per process, so a test comparing several runs on the same logical CPUs
starts one child instead of one per run. Each strategy is made once and handed to
`tfpar.train.train(runtime=...)` (a second run on a runtime repeats a fresh process's run
bit for bit: tests/test_train.py checks it); the Keras dtype policy is reset to float32
before each run, since a mixed-precision run sets the global policy. Multi-worker configs
do not belong here (one strategy per process).

A run may carry a third element, `{"graft": [STEP, CHECKPOINT_PATH]}`: after STEP steps
the run replaces its model's weights with the checkpoint's (`tfpar.checkpoint`'s layout)
and trains on, its data iterator and optimizer untouched; the weights it read go to
`OUT_PREFIX_<name>_grafted.npz`. That is the uninterrupted run a resumed one must equal
bit for bit: the same weights at STEP, the data stream never restarted.

Saves each run's final weights to `OUT_PREFIX_<name>.npz` and prints one JSON line
`{name: summary}` with train_child.py's keys and `strategy_object` (the `id` of the
model's strategy: equal for runs on one runtime, the runtimes being kept alive) and
`fused_updates` (how many variable updates the fused momentum kernel was traced for,
`tfpar.optimizers.FusedMomentumMixin`). The name of the run in progress goes to
stderr first, so a failure's tail says which run failed.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig, devices  # noqa: E402

KEYS = ("replicas", "workers", "steps", "final_loss", "loss_history", "comm",
        "resumed_from_step", "strategy", "validation")


def main():
    runs, prefix = json.loads(sys.argv[1]), sys.argv[2]
    configs = [(name, ParallelConfig(**settings)) for name, settings, *_ in runs]
    options = {name: extra[0] for name, _, *extra in runs if extra}
    split = {c.cpu_devices for _, c in configs if c.cpu_devices > 1}
    if len(split) > 1:
        raise SystemExit(f"one CPU split per process, got cpu_devices {sorted(split)}")
    if any(c.strategy not in ("one_device", "mirrored") for _, c in configs):
        raise SystemExit("name strategy=one_device or mirrored for every run "
                         "(multi_worker runs need a process of their own)")
    devices.split_cpu(split.pop() if split else 0)
    import keras
    from tfpar import strategy
    from tfpar.train import train
    runtimes, out = {}, {}
    for name, config in configs:
        print(f"run {name}: {config}", file=sys.stderr, flush=True)
        keras.mixed_precision.set_global_policy("float32")
        key = (config.strategy, config.data_parallel, config.pipeline_stages, config.collective)
        if key not in runtimes:
            runtimes[key] = strategy.make_runtime(config)
        callbacks = []
        if "graft" in options.get(name, {}):
            callbacks.append(graft_callback(*options[name]["graft"],
                                            f"{prefix}_{name}_grafted.npz"))
        result, model = train(config, runtime=runtimes[key], callbacks=callbacks)
        np.savez(f"{prefix}_{name}.npz", *[np.asarray(v) for v in model.weights])
        out[name] = {k: result[k] for k in KEYS if k in result}
        # Which strategy object the model was built under: runs on one runtime share it.
        out[name]["strategy_object"] = id(model.distribute_strategy)
        optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        out[name]["fused_updates"] = getattr(optimizer, "tfpar_fused_traced", 0)
    print(json.dumps(out), flush=True)


def graft_callback(step, checkpoint, out):
    """The callback that loads the model's weights from `checkpoint` after `step` steps."""
    import keras
    import tensorflow as tf

    class _Graft(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == step:
                tf.train.Checkpoint(model=self.model).read(checkpoint) \
                    .assert_existing_objects_matched().expect_partial()
                np.savez(out, *[np.asarray(v) for v in self.model.weights])
    return _Graft()


if __name__ == "__main__":
    main()
