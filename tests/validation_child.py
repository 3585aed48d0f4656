"""Child process for tests: `python tests/validation_child.py CASES_JSON OUT_DIR`.

Each case runs in a process forked from this one after its one TensorFlow import
(tests/forking.py), two at a time. A case `{"config": CONFIG}` trains
`ParallelConfig(**CONFIG)` (with `validation_steps`) through `tfpar.train.train` with a
callback that records the `val_loss` Keras hands to callbacks, then evaluates the trained
model once more on the held-out data, and prints one JSON line; a case `{"argv": [...]}`
runs `python -m tfpar.train ARGV`. Prints one JSON line `{"cases": [...]}`, per case in
order `{"returncode", "stdout", "stderr", "seconds"}`.
"""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow  # noqa: E402,F401  (imported once, for every fork)
import keras  # noqa: E402,F401

import tfpar.train  # noqa: E402
from forking import run_forked  # noqa: E402
from tfpar import ParallelConfig, compat  # noqa: E402


def trained(settings):
    config = ParallelConfig(**settings)
    if config.keras == 2:
        import tf_keras as keras_module
    else:
        import keras as keras_module
    seen = []

    class SeesValidation(keras_module.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(float((logs or {}).get("val_loss", math.nan)))

    result, model = tfpar.train.train(config, callbacks=[SeesValidation()])
    out = {"validation": result.get("validation"), "seen_val_loss": seen,
           "loss_history": result["loss_history"], "backend": compat.backend_of(config)}
    if compat.backend_of(config) != "dtensor":
        from tfpar import data
        task = data.make_task(config)
        held_out = data.distributed_validation(model.distribute_strategy, config, task)
        logs = model.evaluate(held_out, steps=config.validation_steps, verbose=0,
                              return_dict=True)
        out["evaluate_again"] = float(logs["loss"])
    print(json.dumps(out), flush=True)


def command_line(argv):
    sys.argv = [tfpar.train.__file__, *argv]
    tfpar.train.run()


def main():
    cases, folder = json.loads(sys.argv[1]), sys.argv[2]
    calls = [(lambda c=c: trained(c["config"])) if "config" in c
             else (lambda c=c: command_line(c["argv"])) for c in cases]
    print(json.dumps({"cases": run_forked(calls, folder)}), flush=True)


if __name__ == "__main__":
    main()
