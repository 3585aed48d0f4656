"""Child process for tests: `python tests/mesh_preemption_child.py CONFIG_JSON OUT_DIR K`.

Trains `ParallelConfig(**CONFIG_JSON)` (a mesh run in one process) three times on one
runtime: `whole`, uninterrupted, without checkpoints; `stopped`, with `checkpoint_dir`
OUT_DIR/ckpt and a callback that sends this process SIGTERM after step K (the signal a
scheduler sends, through the OS, to the run's own handler); `resumed`, the same config
again, without the signal. Saves each run's final state (`tfpar.state` names, `/` as `|`)
to `OUT_DIR/<name>.npz` and prints one JSON line `{name: {"loss_history",
"resumed_from_step", "steps", "preempted", "saved"}}` ("saved": the checkpoint directory's
`.index` files after the run).
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig, devices  # noqa: E402


def main():
    settings, folder, after = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    devices.split_cpu(settings["cpu_devices"])
    import keras

    from tfpar import backends, state
    from tfpar.train import train

    class SigtermAfter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == after:
                os.kill(os.getpid(), signal.SIGTERM)

    config = ParallelConfig(**settings)
    runtime = backends.for_config(config).build_runtime(config)
    ckpt = os.path.join(folder, "ckpt")
    out = {}
    for name, run_config, callbacks in (
            ("whole", config, []),
            ("stopped", config.replace(checkpoint_dir=ckpt), [SigtermAfter()]),
            ("resumed", config.replace(checkpoint_dir=ckpt), [])):
        result, model = train(run_config, callbacks=callbacks, runtime=runtime)
        out[name] = {k: result.get(k) for k in ("loss_history", "resumed_from_step", "steps",
                                                "preempted")}
        out[name]["saved"] = sorted(f for f in os.listdir(ckpt) if f.endswith(".index")) \
            if os.path.isdir(ckpt) else []
        values = {n: e[0]() for n, e in state.LayoutState(model).entries().items()}
        np.savez(os.path.join(folder, f"{name}.npz"),
                 **{n.replace("/", "|"): v for n, v in values.items()})
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
