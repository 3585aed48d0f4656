"""Child process for tests: `python tests/train_configs_child.py CONFIGS_JSON OUT_PREFIX`.

Trains each `ParallelConfig(**c)` of the JSON list one after the other in this process,
on the runtime the first one built (`tfpar.train.train(..., runtime=...)`: one strategy or
DTensor mesh per process), saves config i's final weights to
`OUT_PREFIX.<i>[.worker<w>].npz` and prints one JSON line: a list of metric summaries.
Under `tfpar.launch` every worker does the same.

A config may carry `"dense_gradients": true` (not a `ParallelConfig` field): its optimizer
is then handed every `IndexedSlices` gradient (an embedding's) as a dense tensor, the
reference a DTensor mesh's dense gradients are compared with (Keras's Adam squares an
`IndexedSlices` gradient slice by slice, before duplicate rows are summed).
"""

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig, backends, optimizers  # noqa: E402
from tfpar.train import train  # noqa: E402

DENSE = "dense_gradients"


@contextlib.contextmanager
def dense_gradients(on):
    """While on, `tfpar.optimizers.make_optimizer` returns optimizers whose `apply`
    densifies `IndexedSlices` gradients first."""
    if not on:
        yield
        return
    import tensorflow as tf
    make = optimizers.make_optimizer

    def make_dense(config):
        optimizer = make(config)
        apply = optimizer.apply

        def apply_dense(grads, trainable_variables=None):
            return apply([tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                          for g in grads], trainable_variables)
        optimizer.apply = apply_dense
        return optimizer
    optimizers.make_optimizer = make_dense
    try:
        yield
    finally:
        optimizers.make_optimizer = make


def main():
    raw = json.loads(sys.argv[1])
    configs = [ParallelConfig(**{k: v for k, v in c.items() if k != DENSE}) for c in raw]
    runtime = backends.for_config(configs[0]).build_runtime(configs[0])
    worker = os.environ.get("TFPAR_WORKER_INDEX")
    out = []
    for i, config in enumerate(configs):
        with dense_gradients(raw[i].get(DENSE, False)):
            result, model = train(config, runtime=runtime)
        if result.get("strategy") == "DTensorMesh":  # sharded on a mesh: gather
            from tfpar.layout.values import to_host
            arrays = [to_host(v.value) for v in model.weights]
        else:
            arrays = [np.asarray(v) for v in model.weights]
        suffix = f".worker{worker}" if worker is not None else ""
        np.savez(f"{sys.argv[2]}.{i}{suffix}.npz", *arrays)
        keys = ("replicas", "workers", "steps", "final_loss", "loss_history", "comm",
                "strategy", "mesh", "memory")
        out.append({k: result[k] for k in keys if k in result})
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
