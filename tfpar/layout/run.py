"""`train(config)`: a tensor-parallel run of `python -m tfpar.train`.

`python -m tfpar.train --model=transformer --tensor_parallel=2 --data_parallel=2
--cpu_devices=4` comes here: mesh from the config, the model's presets, model and
optimizer built on the mesh, the generated (or user) data split on the `batch` axis,
`MeshTrainer.fit`, the metrics dict of `tfpar.metrics.summarize`.
"""

import math
import types

import keras
import tensorflow as tf
from absl import logging

from tfpar import models
from tfpar import checkpoint, data, devices, metrics
from tfpar.errors import ConfigError, TfparError
from tfpar.layout import presets, values
from tfpar.layout.mesh import describe, mesh_for_config
from tfpar.layout.trainer import build_on_mesh


def check_config(config):
    """Raises `ConfigError` for settings the tensor-parallel path does not support."""
    unsupported = {"mixed_precision": "none", "compression": "none", "grad_accum_steps": 1,
                   "pipeline_stages": 1}
    for name, works in unsupported.items():
        if getattr(config, name) != works:
            raise ConfigError(name, getattr(config, name),
                              f"--tensor_parallel={config.tensor_parallel} runs on DTensor, "
                              f"which supports only {name}={works!r} in tfpar so far")
    if config.strategy == "multi_worker":
        raise ConfigError("strategy", config.strategy,
                          "tensor parallelism runs in one process; use --strategy=auto")
    presets.model_presets(config.model)


def make_optimizer(config):
    """The Keras optimizer `config` asks for (unbuilt), as `tfpar.train` makes it."""
    rate = config.scaled_learning_rate
    if config.warmup_steps:
        from tfpar.train import LinearWarmup  # the schedule train.py defines
        rate = LinearWarmup(rate, config.warmup_steps)
    if config.optimizer == "adam":
        return keras.optimizers.Adam(learning_rate=rate)
    return keras.optimizers.SGD(learning_rate=rate,
                                momentum=0.9 if config.optimizer == "momentum" else 0.0)


def build(config, task, mesh=None):
    """Builds `(mesh, model, MeshTrainer)` for `config` on its mesh (or `mesh`)."""
    mesh = mesh or mesh_for_config(config)
    keras.utils.set_random_seed(config.seed)
    rules = presets.preset_rules(presets.model_presets(config.model))
    model, trainer = build_on_mesh(
        mesh, rules,
        lambda: models.build(config.model, task.input_shape, task.num_classes,
                             width=config.model_width, depth=config.model_depth),
        lambda: make_optimizer(config),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return mesh, model, trainer


def train(config, task=None):
    """Trains `config` with tensor parallelism; returns `(metrics dict, model)`.

    Call in a fresh process (`config.cpu_devices` is applied first).

    Raises:
        ConfigError: an unsupported setting, or degrees that do not match the devices.
        TfparError: the loss became NaN or infinite.
    """
    check_config(config)
    devices.split_cpu(config.cpu_devices)
    task = task or data.make_task(config)
    mesh, model, trainer = build(config, task)
    logging.info("%s; %d/%d parameters per device", describe(mesh),
                 values.shard_sizes(model.weights)[0], model.count_params())
    runtime = types.SimpleNamespace(strategy=mesh, replicas=mesh.shape[0], workers=1,
                                    worker_index=0, is_chief=True)
    recorder = metrics.StepRecorder()
    callbacks = [recorder]
    start = 0
    if config.checkpoint_dir:
        checkpointer = checkpoint.Checkpointer(config, model, runtime)
        start = checkpointer.restore()
        callbacks.append(checkpointer)
    batches = iter(data.pipeline_dataset(config, task, tf.distribute.InputContext(), start))
    step = start
    while step < config.steps:
        epoch, length = step // config.steps_per_epoch, min(
            config.steps_per_epoch - step % config.steps_per_epoch, config.steps - step)
        trainer.fit(batches, initial_epoch=epoch, epochs=epoch + 1, steps_per_epoch=length,
                    callbacks=callbacks, verbose=config.verbose)
        bad = [v for v in recorder.batch_losses if not math.isfinite(v)]
        if bad:
            raise TfparError(f"loss became {bad[0]} (on_nan={config.on_nan}); lower "
                             "--learning_rate or check the data")
        step += length
    if config.checkpoint_dir and start < config.steps:
        checkpointer.save()
    result = metrics.summarize(config, runtime, recorder, values.shard_sizes(model.weights))
    result["strategy"] = "DTensorMesh"
    result["mesh"] = {"data_parallel": mesh.shape[0], "tensor_parallel": mesh.shape[1]}
    result["resumed_from_step"] = start
    if config.metrics_json:
        metrics.write_json(config.metrics_json, result)
    return result, model
