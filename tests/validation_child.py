"""Child process for tests: `python tests/validation_child.py CONFIG_JSON`.

Trains `ParallelConfig(**CONFIG_JSON)` (with `validation_steps`) through `tfpar.train.train`
with a callback that records the `val_loss` Keras hands to callbacks, then evaluates the
trained model once more on the held-out data; prints one JSON line.
"""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar import ParallelConfig, compat  # noqa: E402
from tfpar.train import train  # noqa: E402


def main():
    config = ParallelConfig(**json.loads(sys.argv[1]))
    if config.keras == 2:
        import tf_keras as keras_module
    else:
        import keras as keras_module
    seen = []

    class SeesValidation(keras_module.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(float((logs or {}).get("val_loss", math.nan)))

    result, model = train(config, callbacks=[SeesValidation()])
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


if __name__ == "__main__":
    main()
