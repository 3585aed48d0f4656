"""`build(config, task)`: the model and `MeshTrainer` of a tensor-parallel run.

`python -m tfpar.train --model=transformer --tensor_parallel=2 --data_parallel=2
--cpu_devices=4` builds here (driven by `tfpar.backends.dtensor`): mesh from the config, the
model's presets, model and optimizer built on the mesh. Which settings combine with
`tensor_parallel > 1` is `tfpar.compat`'s table.
"""

import keras

from tfpar import models, optimizers, recompute
from tfpar.layout import presets, reduction, variables
from tfpar.zero import fsdp
from tfpar.layout.mesh import mesh_for_config
from tfpar.layout.trainer import build_on_mesh


def build(config, task, mesh=None):
    """Builds `(mesh, model, MeshTrainer)` for `config` on its mesh (or `mesh`); with
    `pipeline_stages > 1`, `mesh` is the list of the stages' meshes and the model and
    trainer come from `tfpar.layout.pipeline`.

    Raises:
        ConfigError: the model has no tensor-parallel presets, or the degrees do not
            match the devices.
    """
    if config.dims.pp_enabled:  # dp × tp × pp: one mesh per stage
        from tfpar.layout import pipeline
        model, trainer = pipeline.build(config, task, mesh, lambda: _optimizer(config))
        return mesh, model, trainer
    # ZeRO-3 without tensor parallelism: no `model` axis to lay out; with it each weight
    # split over `model` by the presets is split over `batch` on top (_build_model).
    rules = ([] if config.zero_stage == 3 and not config.dims.tp_enabled
             else presets.preset_rules(presets.model_presets(config.model,
                                                             config.sequence_parallel)))
    mesh = mesh or mesh_for_config(config)
    keras.utils.set_random_seed(config.seed)
    model, trainer = build_on_mesh(
        mesh, rules,
        lambda: _build_model(config, task),
        lambda: _optimizer(config),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        grad_accum_steps=config.grad_accum_steps,
        compression=None if config.compression == "none" else config.compression,
        error_feedback=config.error_feedback,
        codec_options=reduction.codec_options(config))
    return mesh, model, trainer


def _build_model(config, task):
    # ZeRO-3 (`tfpar.zero.fsdp`): weights split over `batch`, slots follow their weight.
    with variables.weights_over_batch(config.zero_stage == 3):
        model = models.build(config.model, task.input_shape, task.num_classes,
                             width=config.model_width, depth=config.model_depth)
    if config.zero_stage == 3:
        # Before recompute: its layers already recompute.
        fsdp.gather_per_layer(model, config.zero_gather, config.zero_prefetch,
                              config.zero_reshard_after_forward,
                              config.zero_keep_last_layers)
    else:
        fsdp.dtensor_gathers()
    recompute.apply(model, config)
    return model


def _optimizer(config):
    """The run's optimizer for the mesh step: no aggregator (the mesh step compresses
    over its `batch` axis itself, `tfpar.layout.reduction`); with fp16 Keras's own `LossScaleOptimizer`, whose skip decision the mesh step
    makes once for the whole mesh (the tf.distribute variant all-reduces it over replicas)."""
    optimizer = optimizers.make_optimizer(
        config.replace(mixed_precision="none", compression="none", zero_stage=0,
                       zero_gather="fp32",
                       fused_update=False))  # the stateless step updates with Keras's ops
    if config.mixed_precision == "fp16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
