"""Child process for tests: `python -m tfpar.launch --workers=2 -- python
tests/straggler_child.py CONFIGS_JSON OUT_PREFIX`.

Trains each `ParallelConfig(**c)` of the JSON list twice on one runtime (one
`MultiWorkerMirroredStrategy`): first with worker 1 sleeping `LAG_S` before the steps in
`LAG_AT` (a straggler: the other worker waits for it inside the collectives), then the same
config without the lag. Saves every run's final weights to
`OUT_PREFIX.worker<i>.<run>.<lagged|steady>.npz` and prints a one-line JSON summary: per
config, `{"lagged": run, "steady": run}`.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import ParallelConfig, backends  # noqa: E402
from tfpar.train import train  # noqa: E402

LAG_S = 0.5
LAG_AT = (1, 2, 5, 6, 9)


class Straggle(keras.callbacks.Callback):
    """Worker 1 lags `LAG_S` seconds before the steps in `LAG_AT`."""

    def __init__(self, worker, lag=True):
        super().__init__()
        self.worker, self.lag, self.step, self.lagged = worker, lag, 0, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.lag and self.worker == 1 and self.step in LAG_AT:
            time.sleep(LAG_S)
            self.lagged += 1
        self.step += 1


def main():
    configs = [ParallelConfig(**c) for c in json.loads(sys.argv[1])]
    worker = int(os.environ["TFPAR_WORKER_INDEX"])
    runtime = backends.for_config(configs[0]).build_runtime(configs[0], None, None)
    out = []
    for n, config in enumerate(configs):
        runs = {}
        for name in ("lagged", "steady"):
            lag = Straggle(worker, lag=name == "lagged")
            result, model = train(config, runtime=runtime, callbacks=[lag])
            np.savez(f"{sys.argv[2]}.worker{worker}.{n}.{name}.npz",
                     *[np.asarray(v) for v in model.trainable_weights])
            runs[name] = {"compression": config.compression, "lagged": lag.lagged,
                          "loss_history": result["loss_history"], "comm": result.get("comm")}
        out.append(runs)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
