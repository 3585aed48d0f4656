"""ZeRO-3 (FSDP) from a user's own `model.fit`: `FullyShardedDataParallel`.

What `python -m tfpar.train --zero_stage=3` builds (`tfpar.layout.run`, `tfpar.zero.fsdp`),
as a Keras distribution:

>>> tfpar.layout.enable()
>>> mesh = keras.distribution.DeviceMesh((4,), ["batch"],
...                                      keras.distribution.list_devices())
>>> keras.distribution.set_distribution(tfpar.layout.FullyShardedDataParallel(mesh))
>>> model = build_my_model()
>>> model.compile(optimizer=tfpar.DistributedOptimizer(keras.optimizers.Adam(1e-3),
...                                                    compression="int8"),
...               loss="sparse_categorical_crossentropy")
>>> model.fit(x, y, batch_size=32)

Every trainable weight is split over the mesh's `batch` axis on its first dimension that
divides by the replicas (`tfpar.layout.variables.over_batch`; a weight with none, e.g. a
bias of 10 over 4, stays whole), on top of its `layout_map` layout if one is given (a
mesh `("batch", "model")` with tensor-parallel rules: ZeRO-3 × TP, as the CLI's); the
optimizer's slots follow their weight. Non-trainable state (moving statistics, seeds) and
the optimizer's and metrics' own variables stay whole. Each device holds 1/N of the
weights and of the optimizer state between steps.

At the model's first `fit`/`evaluate`/`predict` each top-level layer with split weights
gathers them just before it runs (`tfpar.zero.fsdp.gather_per_layer`: as all-gathers on a
mesh with no other axis of size > 1, recomputed in the backward pass unless
`reshard_after_forward=False`, each gather prefetched one layer early); a layer with
non-trainable weights, and every layer with `gather_per_layer=False`, has its weights
gathered at the start of the step (`fsdp.gathered`). The gradient of a gathered weight
lands on its piece (DTensor's fp32 reduce-scatter over `batch`); with a
`tfpar.DistributedOptimizer(..., compression="fp16"|"bf16"|"int8")` each replica's
gradient goes through ZeRO-3's compressed reduce-scatter instead
(`tfpar.zero.reduce_scatter`, `tfpar.layout.keras_step`). `weight_gather="int8"` gathers
weights of rank >= 2 as int8 codes (ZeRO++'s qwZ, the CLI's `--zero_gather=int8`).

Refused with one line (rows of `tfpar.compat`): a codec ZeRO-3 does not reduce-scatter
(top-k, threshold, PowerSGD, lowbit: `KERAS_ZERO3_CODEC`), a mesh with a `stage` axis
(`KERAS_ZERO3_PIPELINE`); a mesh without an axis named "batch".
"""

import keras

from tfpar import compat
from tfpar.errors import ConfigError
from tfpar.layout.mesh import BATCH
from tfpar.zero import fsdp


class FullyShardedDataParallel(keras.distribution.ModelParallel):
    """Keras's `ModelParallel` with every trainable weight split over the `batch` axis too
    (ZeRO stage 3 / FSDP; see the module docstring).

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` with an axis named "batch" (and
            optionally "model"); default: every device of `list_devices()` on one "batch"
            axis, or `layout_map`'s mesh.
        layout_map: a `keras.distribution.LayoutMap` on that mesh whose rules (tensor
            parallelism over "model") are kept; default: none, every weight split over
            "batch" only.
        gather_per_layer: gather each layer's weights just before it runs (default), or
            all at the start of the step.
        weight_gather: "fp32", or "int8" (weights of rank >= 2 gathered as int8 codes).
        prefetch: each per-layer gather issued one layer early (the same values).
        reshard_after_forward: recompute each layer in the backward pass (regathering its
            weights) instead of keeping its whole weights and activations.
        keep_last_layers: with resharding, how many of the last layers to keep whole
            from forward to backward (-1: `fsdp.kept_layers`'s choice).
        batch_dim_name: "batch".

    Raises:
        ConfigError: the mesh has no "batch" axis, or has a "stage" axis
            (`compat.KERAS_ZERO3_PIPELINE`), `layout_map` is on another mesh, or
            `weight_gather` is not "fp32" or "int8".

    Examples:
        >>> keras.distribution.set_distribution(
        ...     tfpar.layout.FullyShardedDataParallel(mesh, weight_gather="int8"))
    """

    tfpar_weights_over_batch = True  # read by `tfpar.layout.variables._initialize`

    def __init__(self, device_mesh=None, *, layout_map=None, gather_per_layer=True,
                 weight_gather="fp32", prefetch=True, reshard_after_forward=True,
                 keep_last_layers=0, batch_dim_name=BATCH, **kwargs):
        if device_mesh is None:
            device_mesh = (layout_map.device_mesh if layout_map is not None else
                           keras.distribution.DeviceMesh(
                               (len(keras.distribution.list_devices()),), [BATCH],
                               keras.distribution.list_devices()))
        axes = tuple(device_mesh.axis_names)
        compat.enforce(compat.KERAS_ZERO3_PIPELINE, compat.view(
            backend="dtensor", zero_stage=3, keras_distribution=True, mesh_axes=axes))
        if BATCH not in axes:
            raise ConfigError("device_mesh", axes, "FullyShardedDataParallel splits weights "
                              "over the axis named 'batch'; name the data-parallel axis "
                              "'batch' (and the tensor-parallel one 'model')")
        if layout_map is None:
            layout_map = keras.distribution.LayoutMap(device_mesh)
        elif layout_map.device_mesh is not device_mesh:
            raise ConfigError("layout_map", "a LayoutMap on another DeviceMesh",
                              "give FullyShardedDataParallel the layout map's own mesh, or "
                              "leave device_mesh out")
        if weight_gather not in ("fp32", "int8"):
            raise ConfigError("weight_gather", weight_gather, "one of 'fp32', 'int8'")
        super().__init__(layout_map=layout_map, batch_dim_name=batch_dim_name, **kwargs)
        self.gather_per_layer, self.weight_gather = bool(gather_per_layer), weight_gather
        self.prefetch, self.reshard_after_forward = bool(prefetch), bool(reshard_after_forward)
        self.keep_last_layers = int(keep_last_layers)


def is_fsdp(distribution):
    """Whether `distribution` splits every weight over `batch` (`FullyShardedDataParallel`)."""
    return bool(getattr(distribution, "tfpar_weights_over_batch", False))


def set_lowering(model):
    """Before each `fit`/`evaluate`/`predict` of a mesh model: DTensor's lowering of
    gathers for this model — all-gathers for one whose layers gather per layer on a mesh
    with no second split axis (`fsdp.collective_gathers`), DTensor's own for any other
    (`fsdp.dtensor_gathers`). The setting is the process's and read when a step runs: set
    once at a model's build, a 4-device ZeRO-3 model's first fit after a 2 x 2 one was
    built left it on for the 2 x 2 model's next fit, which trained 0.66 off one device
    (a review's probe; 3e-8 with it set here)."""
    mesh = fsdp.split_mesh(model.weights)  # (a model frozen after its fit: no trainable)
    if getattr(model, "_tfpar_fsdp_layers", None) and mesh is not None:
        fsdp.collective_gathers(mesh)
    else:
        fsdp.dtensor_gathers()


def prepare(model, distribution):
    """Before the first step of a mesh model: a model whose weights are split over `batch`
    under a `FullyShardedDataParallel` gets its per-layer gathers (`fsdp.gather_per_layer`
    with the distribution's settings; once per model); a model with
    none takes DTensor's own lowering of gathers back (`fsdp.dtensor_gathers`), as the
    CLI's mesh models do. Returns the names of the layers that gather per layer."""
    if not fsdp.split_over_batch(model.trainable_variables):
        fsdp.dtensor_gathers()
        return []
    done = getattr(model, "_tfpar_fsdp_layers", None)
    if done is not None or not is_fsdp(distribution):
        # a LayoutMap that puts weights on `batch` under a plain ModelParallel: gathered
        # whole at the start of the step (`fsdp.gathered`), as before
        return done or []
    names = []
    if distribution.gather_per_layer:
        names = fsdp.gather_per_layer(model, distribution.weight_gather,
                                      distribution.prefetch,
                                      distribution.reshard_after_forward,
                                      distribution.keep_last_layers)
    object.__setattr__(model, "_tfpar_fsdp_layers", names)
    return names
