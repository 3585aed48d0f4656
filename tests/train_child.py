"""Child process for tests: `python tests/train_child.py CONFIG_JSON OUT_PREFIX`.

Trains `ParallelConfig(**CONFIG_JSON)` with `tfpar.train.train`, saves the final weights to
`OUT_PREFIX[.worker<i>].npz` and prints a one-line JSON summary of the metrics.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig  # noqa: E402
from tfpar.train import train  # noqa: E402


def main():
    config = ParallelConfig(**json.loads(sys.argv[1]))
    result, model = train(config)
    worker = os.environ.get("TFPAR_WORKER_INDEX")
    path = sys.argv[2] + (f".worker{worker}" if worker is not None else "") + ".npz"
    if result.get("strategy") == "DTensorMesh":  # weights sharded on a mesh: gather them
        from tfpar.layout.values import to_host
        arrays = [to_host(v.value) for v in model.weights]
    else:
        arrays = [np.asarray(v) for v in model.weights]
    np.savez(path, *arrays)
    if result.get("strategy") == "DTensorMesh" and result.get("workers", 1) > 1:
        # The gathers above are collectives after train()'s own barrier: worker 0, which
        # hosts the coordination service, must not leave before the others finish them
        # (a loaded run saw worker 1's gather reset by worker 0's exit).
        from tfpar.strategy import wait_for_workers
        wait_for_workers("gathered", timeout_s=120)
    keys = ("replicas", "workers", "steps", "final_loss", "loss_history", "comm",
            "resumed_from_step", "strategy")
    print(json.dumps({k: result[k] for k in keys if k in result}), flush=True)


if __name__ == "__main__":
    main()
