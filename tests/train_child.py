"""Child process for tests: `python tests/train_child.py CONFIG_JSON OUT_PREFIX`.

Trains `ParallelConfig(**CONFIG_JSON)` with `tfpar.train.train`, saves the final weights to
`OUT_PREFIX[.worker<i>].npz` and prints a one-line JSON summary of the metrics.

Fault injection for tests: with `KILL_AT_STEP=S` and `KILL_WORKER=W` in the environment,
worker W SIGKILLs itself after step S on the first attempt (`TFPAR_RESTART` 0 or unset).
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig  # noqa: E402
from tfpar.train import train  # noqa: E402


def fault_injector():
    import keras

    at, worker = os.environ.get("KILL_AT_STEP"), os.environ.get("KILL_WORKER", "0")
    first_attempt = os.environ.get("TFPAR_RESTART", "0") == "0"
    me = os.environ.get("TFPAR_WORKER_INDEX", "0")

    class Kill(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            Kill.steps += 1
            if at and first_attempt and me == worker and Kill.steps == int(at):
                print(f"KILLING worker {me} after step {Kill.steps}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    return Kill()


def main():
    config = ParallelConfig(**json.loads(sys.argv[1]))
    result, model = train(config, callbacks=[fault_injector()])
    worker = os.environ.get("TFPAR_WORKER_INDEX")
    path = sys.argv[2] + (f".worker{worker}" if worker is not None else "") + ".npz"
    np.savez(path, *[np.asarray(v) for v in model.weights])
    keys = ("replicas", "workers", "steps", "final_loss", "loss_history", "comm",
            "resumed_from_step", "strategy")
    print(json.dumps({k: result[k] for k in keys if k in result}), flush=True)


if __name__ == "__main__":
    main()
