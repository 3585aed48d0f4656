"""Tensor parallelism on DTensor: mesh, layout rules and presets, DVariables, an exact
training step, `fit`/`evaluate`/`predict`, checkpoints that restore across meshes.

Keras's `keras.distribution` vocabulary (`DeviceMesh`, `LayoutMap`, `ModelParallel`) is
the user API; tfpar supplies the TensorFlow side Keras leaves unfinished.

>>> from tfpar import layout
>>> mesh = layout.make_mesh(data_parallel=2, tensor_parallel=2)
>>> model, trainer = layout.build_on_mesh(
...     mesh, layout.preset_rules(["megatron_mlp"]), lambda: models.mlp((32,), 10),
...     lambda: keras.optimizers.Adam(1e-3),
...     keras.losses.SparseCategoricalCrossentropy(from_logits=True))
>>> trainer.fit(batches)

Modules: `mesh` (devices → mesh), `presets` (weight-path rules), `variables`
(DVariable creation and the plain-variable check), `optimizer` (stateless Keras
updates), `step` (the compiled exact steps), `newaxis` (a DTensor work-around),
`values` (host ↔ mesh), `trainer` (`MeshTrainer`), `keras_distribution` (`enable()`:
Keras's own `set_distribution(ModelParallel(...))` + `model.fit`), `keras_step` (the
model's own Keras loss, metrics and steps on the mesh), `keras_pipeline` (a mesh
`("stage", "batch", "model")`: dp × tp × pp in a user's `model.fit`,
`PipelineParallel`), `keras_fsdp` (ZeRO-3 in a user's `model.fit`,
`FullyShardedDataParallel`), `multi_client` (DTensor
across worker processes from `TF_CONFIG`), `run` (model and trainer of a
`python -m tfpar.train --tensor_parallel=N` run, driven by `tfpar.backends.dtensor`).
"""

from tfpar.layout.keras_distribution import disable, enable, is_enabled
from tfpar.layout.keras_fsdp import FullyShardedDataParallel
from tfpar.layout.keras_pipeline import PipelineParallel
from tfpar.layout.mesh import BATCH, MODEL, make_mesh, mesh_for_config
from tfpar.layout.optimizer import stateless_optimizer
from tfpar.layout.presets import (attention_heads, layout_map, megatron_mlp, model_presets,
                                  preset_rules, vocab_parallel)
from tfpar.layout.trainer import MeshTrainer, build_on_mesh
from tfpar.layout.values import batch_to_mesh, shard_sizes, to_host, to_mesh
from tfpar.layout.variables import check_dvariables, is_dvariable, variable_scope

__all__ = ["enable", "disable", "is_enabled", "FullyShardedDataParallel", "PipelineParallel", "BATCH", "MODEL", "make_mesh", "mesh_for_config",
           "stateless_optimizer",
           "attention_heads", "layout_map", "megatron_mlp", "model_presets",
           "preset_rules", "vocab_parallel", "MeshTrainer", "build_on_mesh",
           "batch_to_mesh", "shard_sizes", "to_host", "to_mesh", "check_dvariables",
           "is_dvariable", "variable_scope"]
