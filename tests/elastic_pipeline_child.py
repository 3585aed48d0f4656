"""Child process for tests/test_elastic_pipeline.py: `python tests/elastic_pipeline_child.py
CONFIGS_JSON OUT_PREFIX`.

Trains each `ParallelConfig(**c)` of the JSON list with `tfpar.train.train`, one after the
other on the runtime the first built (`train` re-lays out a pipeline across workers for an
elastic launch's world, `tfpar.relayout`). A worker that serves a stage to the chief ends
inside `train` (exit 0). The process that ran `fit` saves config i's final weights to
`OUT_PREFIX.<i>.npz`, every stage optimizer's variables, stage after stage, to
`OUT_PREFIX.<i>.optimizer.npz`, and prints one JSON line: a list of metric summaries, each
with, per stage, the tasks/devices that hold its weights (`devices`) and its optimizer's
variables (`slots`) and its optimizer's step count (`iterations`).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig, backends, relayout  # noqa: E402
from tfpar.train import train  # noqa: E402


def _copies(variable):
    """A (mirrored) Keras variable's per-device values."""
    return getattr(variable.value, "values", (variable.value,))


def _where(variables):
    return sorted({c.device.replace("/device:", "/") for v in variables for c in _copies(v)})


def _trained(config, runtime, prefix):
    result, model = train(config, runtime=runtime)
    np.savez(prefix + ".npz", *[np.asarray(v) for v in model.weights])
    optimizers = getattr(model, "stage_optimizers", None) or [model.optimizer]
    np.savez(prefix + ".optimizer.npz",
             *[np.asarray(_copies(v)[0]) for o in optimizers for v in o.variables])
    stages = getattr(model, "stages", [model])
    keys = ("replicas", "workers", "steps", "final_loss", "loss_history", "strategy",
            "resumed_from_step", "pipeline")
    return {**{k: result[k] for k in keys if k in result},
            "devices": [_where(s.weights) for s in stages],
            "slots": [_where(o.variables) for o in optimizers],
            "iterations": [int(np.asarray(_copies(o.iterations)[0])) for o in optimizers]}


def main():
    configs = [relayout.for_cluster(ParallelConfig(**c)) for c in json.loads(sys.argv[1])]
    runtime = backends.for_config(configs[0]).build_runtime(configs[0])
    out = [_trained(c, runtime, f"{sys.argv[2]}.{i}") for i, c in enumerate(configs)]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
