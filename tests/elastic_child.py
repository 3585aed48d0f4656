"""Child process for tests: `python tests/elastic_child.py CONFIG_JSON OUT.npz [TRAIN_JSON]`.

Builds the run of `ParallelConfig(**CONFIG_JSON)` (model, optimizer, aggregator), restores
its checkpoint and saves, for each error-feedback residual, the rows the checkpoint holds
(`saved_<k>`, one per replica that wrote it) and the rows every local replica now holds
(`restored_<k>`), without training a step.

With TRAIN_JSON, it then trains `ParallelConfig(**TRAIN_JSON)` on the same runtime
(`tfpar.train.train(runtime=...)`: one TensorFlow start for both), after a line
`elastic_child: training` on stderr (what the training printed follows it), and reports
that run's summary under "train".
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar import ParallelConfig, backends, checkpoint, data, state  # noqa: E402


def main():
    config = ParallelConfig(**json.loads(sys.argv[1]))
    backend = backends.for_config(config)
    runtime = backend.build_runtime(config)
    model = backend.build_model(config, runtime, data.make_task(config))
    checkpointer = checkpoint.Checkpointer(config, model, runtime)
    step = checkpointer.restore()
    reader = tf.train.load_checkpoint(config.checkpoint_dir)
    aggregator = model.optimizer.tfpar_aggregator
    paths = state._positions(aggregator, model)  # the weights' paths name the residuals
    arrays = {}
    for key, variable in sorted(aggregator.residuals.items(), key=lambda kv: int(kv[0])):
        arrays[f"restored_{key}"] = np.stack(
            [np.asarray(v) for v in runtime.strategy.experimental_local_results(variable)])
        arrays[f"saved_{key}"] = reader.get_tensor(
            state.key(f"codec/{paths[int(key)]}/residual"))
    np.savez(sys.argv[2], **arrays)
    out = {"step": step, "replicas": runtime.replicas, "elastic": checkpointer.elastic}
    if len(sys.argv) > 3:
        from tfpar.train import train
        print("elastic_child: training", file=sys.stderr, flush=True)
        result, _ = train(ParallelConfig(**json.loads(sys.argv[3])), runtime=runtime)
        out["train"] = {k: result[k] for k in ("steps", "loss_history", "resumed_from_step")}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
