"""Child process for tests/test_legacy_train.py: `python tests/legacy_child.py RUNS_JSON
PREFIX CPUS [CLI_JSON]`.

Trains each `[name, settings]` of RUNS_JSON with `keras=2` (legacy Keras, tf_keras) on CPUS
logical CPUs, one runtime per strategy; saves each run's weights to `PREFIX_NAME[.workerI].npz`
and prints one JSON line of reports by name (the metrics' fields, the aggregator's trace
count, the largest spread between replicas' copies, the exported kernels' zeros). The run
named `zeros` uses an aggregator that returns zero gradients. With CLI_JSON (argv of
`python -m tfpar.train`) that command runs in a process forked alongside the runs; the line
is then `{"runs": ..., "cli": ...}` (tests/forking.py's results).
"""

import json
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))

from tfpar import ParallelConfig, devices  # noqa: E402

Config = ParallelConfig

runs, prefix, cpus = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
cli = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402
import tfpar.train  # noqa: E402
from tfpar import compression, strategy  # noqa: E402
from tfpar.train import train  # noqa: E402

class Zeros(compression.NoneAggregator):
    """Returns zero gradients: if tf_keras uses the hook, SGD cannot move."""
    def all_reduce_sum(self, grads, variables):
        self.trace_count += 1
        return [tf.zeros_like(g) for g in grads]

worker = os.environ.get("TFPAR_WORKER_INDEX")
suffix = f".worker{worker}" if worker is not None else ""
runtimes, out = {}, {}
make_aggregator = compression.make_aggregator


def train_runs():
    devices.split_cpu(cpus)
    for name, settings in runs:
        config = Config(**{"keras": 2, **settings})
        if config.strategy not in runtimes:
            runtimes[config.strategy] = strategy.make_runtime(config)
        zeros = Zeros() if name == "zeros" else None
        compression.make_aggregator = (lambda c, **kw: zeros) if zeros else make_aggregator
        result, model = train(config, runtime=runtimes[config.strategy])
        agg = getattr(model.optimizer, "tfpar_aggregator", None)
        report = {k: result[k] for k in ("replicas", "workers", "strategy", "steps", "final_loss",
                                         "loss_history", "comm", "pruning", "qat") if k in result}
        report["traced"] = agg.trace_count if agg is not None else 0
        # Largest difference between the replicas' copies of any variable (masks, ranges, ...).
        report["replica_spread"] = max(
            float(np.max(np.abs(np.asarray(c) - np.asarray(copies[0])), initial=0.0))
            for w in model.weights
            for copies in [runtimes[config.strategy].strategy.experimental_local_results(w)]
            for c in copies)
        # Only the chief exports; only it reads the export (another worker would race its write).
        export = config.export_dir if worker in (None, "0") else None
        if config.prune_sparsity and export:
            saved = tf_keras.models.load_model(os.path.join(export, "model.keras"))
            report["exported_zeros"] = {w.name: float(np.mean(w.numpy() == 0))
                                        for w in saved.weights if "kernel" in w.name}
        if config.qat and export:
            report["exported_files"] = sorted(os.listdir(export))
        np.savez(f"{prefix}_{name}{suffix}.npz", *[np.asarray(v) for v in model.trainable_weights])
        out[name] = report
    print(json.dumps(out), flush=True)


def command_line():
    sys.argv = [tfpar.train.__file__, *cli]
    tfpar.train.run()


if cli is None:
    train_runs()
else:
    # `python -m tfpar.train CLI...` forked from this process alongside the runs (tests/
    # forking.py): both start their own runtime after one import of TensorFlow.
    sys.path.insert(0, TESTS)
    from forking import run_forked
    runs_done, cli_done = run_forked([train_runs, command_line], os.path.dirname(prefix))
    print(json.dumps({"runs": runs_done, "cli": cli_done}), flush=True)
