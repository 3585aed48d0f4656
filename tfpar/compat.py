"""Which settings each backend of the trainer honours: one table, checked before TensorFlow.

`ParallelConfig` calls `check(config)` on construction. A setting a backend cannot honour
is refused with one `ConfigError` line naming the setting, the value and why, never
silently ignored. Imports no TensorFlow.

Backends (what `tfpar.train.train` runs a config on, see `tfpar.backends`):

- `data_parallel`: Keras 3 on a `tf.distribute` strategy (one device, mirrored, multi-worker),
- `pipeline`: the same backend with `pipeline_stages > 1` (a `PipelineModel`); under a
  `TF_CONFIG` of several workers, one stage per worker process (`tfpar.pipeline.remote`,
  which refuses there, once it reads `TF_CONFIG`, what it does not do across workers:
  compression and checkpoints),
- `dtensor`: Keras 3 on a DTensor mesh, for `tensor_parallel > 1` and for `zero_stage=3`
  (under a `TF_CONFIG` of several workers the mesh, and with `pipeline_stages > 1` each
  stage's mesh, spans them),
- `tf_keras`: `keras=2`, legacy Keras on the `tf.distribute` strategies.

`COMBINATIONS` lists what one setting's value excludes (ZeRO with compression or fp16;
on a mesh, compression with fp16 or unpipelined accumulation).

>>> from tfpar import ParallelConfig
>>> backend_of(ParallelConfig(tensor_parallel=2))
'dtensor'
"""

from tfpar.errors import ConfigError

BACKENDS = ("data_parallel", "pipeline", "dtensor", "tf_keras")

# setting -> {backend: (the values that backend honours, why it honours no other)}.
# A setting or backend not listed is honoured with every valid value.
TABLE = {
    "compression": {
        "dtensor": (("none", "fp16", "bf16", "int8"),
                    "the mesh's batch-axis reduction (tfpar.layout.reduction) compresses "
                    "with fp16, bf16 or int8; the other aggregators run on tf.distribute "
                    "collectives"),
    },
    "sequence_parallel": {
        backend: ((False,), "sequence parallelism splits activations over the model axis "
                            "of --tensor_parallel>1")
        for backend in ("data_parallel", "pipeline", "tf_keras")},
    "grad_accum_steps": {
        "tf_keras": ((1,), "tf_keras optimizers do not accumulate gradients"),
    },
    "pipeline_stages": {
        "tf_keras": ((1,), "pipeline parallelism is Keras 3 only"),
    },
    "tensor_parallel": {
        "tf_keras": ((1,), "tensor parallelism is Keras 3 only"),
    },
    "model": {
        "tf_keras": (("mlp", "convnet"), "--keras=2 builds mlp or convnet (the transformer's "
                                         "layers are Keras 3 only)"),
    },
    "checkpoint_dir": {
        "tf_keras": (("",), "checkpoint and resume are Keras 3 only; use --export_dir for the "
                            "final model"),
    },
    "on_nan": {
        "dtensor": (("stop",), "the DTensor step cannot skip a non-finite update; use "
                               "--on_nan=stop"),
        "tf_keras": (("stop",), "skipping non-finite steps is Keras 3 only"),
    },
    "recompute": {
        "tf_keras": (("none",), "recomputation wraps Keras 3 layers"),
    },
    "zero_stage": {
        "pipeline": ((0,), "ZeRO shards one optimizer over data-parallel replicas; a "
                           "pipeline's per-stage optimizers are not sharded"),
        "dtensor": ((0, 3), "a DTensor mesh shards parameters (3, tfpar.layout.fsdp); "
                            "stages 1 and 2 run on tf.distribute (--tensor_parallel=1)"),
        "tf_keras": ((0,), "ZeRO is built on Keras 3's optimizer"),
    },
    "adam_warmup_steps": {
        "tf_keras": ((50,), "tf_keras optimizers keep Adam behind the aggregator (no "
                            "Adam in front of it)"),
    },
    "measure_comm": {
        "pipeline": ((False,), "the communication share is measured on a data-parallel step "
                               "only; a pipeline reports its bubble instead"),
        "dtensor": ((False,), "the communication share is measured on tf.distribute "
                              "collectives only"),
    },
}

# Settings that a value of another setting excludes, on every backend:
# (setting, the values it may take then, when, why).
COMBINATIONS = (
    # dp × tp × pp (`tfpar.layout.pipeline`): every schedule, accumulation, bf16, fp16,
    # the batch-axis codecs and recompute run; checkpoints do not (one checkpoint cannot
    # hold several meshes' variables).
    ("checkpoint_dir", ("",), lambda c: c.tensor_parallel > 1 and c.pipeline_stages > 1,
     "not built yet for --tensor_parallel>1 with --pipeline_stages>1 (one checkpoint "
     "cannot hold several meshes' variables)"),
    ("compression", ("none",),
     lambda c: c.tensor_parallel > 1 and (c.mixed_precision == "fp16" or (
         c.grad_accum_steps > 1 and c.pipeline_stages == 1)),
     "on a DTensor mesh (--tensor_parallel>1) the compressed batch-axis reduction runs "
     "without fp16 loss scaling, and without --grad_accum_steps unless pipelined"),
    ("compression", ("none",), lambda c: c.zero_stage > 0,
     "--zero_stage>0 all-reduces or reduce-scatters fp32 gradients; a compressed "
     "reduce-scatter is not built (use --zero_stage=0)"),
    ("sequence_parallel", (False,), lambda c: c.model != "transformer",
     "sequence parallelism splits the transformer's sequence; --model=mlp and convnet have "
     "none"),
    ("sequence_parallel", (False,), lambda c: c.pipeline_stages > 1,
     "sequence layouts are built for the unpipelined mesh step; use --pipeline_stages=1"),
    ("sequence_parallel", (False,), lambda c: c.compression != "none",
     "the compressed batch-axis reduction maps the step over replicas, where the sequence "
     "layouts are not built; use --compression=none"),
    ("mixed_precision", ("none", "bf16"), lambda c: c.zero_stage > 0,
     "fp16 loss scaling runs the update inside a condition the ZeRO update cannot run "
     "in; use bf16"),

    ("tensor_parallel", (1,), lambda c: c.zero_stage == 3,
     "--zero_stage=3 splits every weight over the data-parallel axis of a DTensor mesh; "
     "with tensor parallelism it is not tested (use --zero_stage=0)"),
)

_NAMES = {"data_parallel": "data parallelism", "pipeline": "--pipeline_stages>1",
          "dtensor": "--tensor_parallel>1 (DTensor; also --zero_stage=3)",
          "tf_keras": "--keras=2"}


def backend_of(config):
    """The backend that runs `config`: one of `BACKENDS`."""
    if getattr(config, "keras", 3) == 2:
        return "tf_keras"
    if config.tensor_parallel > 1 or (getattr(config, "zero_stage", 0) == 3
                                      and config.pipeline_stages == 1):
        return "dtensor"  # ZeRO-3: tfpar.layout.fsdp
    if config.pipeline_stages > 1:
        return "pipeline"
    return "data_parallel"


def check(config):
    """Raises `ConfigError` for the first setting `config`'s backend cannot honour."""
    backend = backend_of(config)
    for setting, rules in TABLE.items():
        if backend not in rules or not hasattr(config, setting):
            continue
        honoured, why = rules[backend]
        value = getattr(config, setting)
        if value not in honoured:
            raise ConfigError(setting, value, f"not supported with {_NAMES[backend]}: {why}")
    for setting, honoured, when, why in COMBINATIONS:
        if when(config) and getattr(config, setting) not in honoured:
            raise ConfigError(setting, getattr(config, setting), f"not supported: {why}")


def mesh_degrees(data_parallel, tensor_parallel, stages, devices, where, cpu_hint=True):
    """The `batch` size of each stage's `data_parallel` × `tensor_parallel` mesh when
    `stages` such meshes fill `devices` devices (`data_parallel=0`: what the other two
    leave). One rule for the check before TensorFlow (`check_devices`) and the meshes built
    after it (`tfpar.layout`); `where` names the devices in the message ("local devices",
    "logical CPUs of --cpu_devices=4", ...); `cpu_hint=False` where `--cpu_devices` is not
    the count (devices of several processes).

    Raises:
        ConfigError: naming the degree that does not fit, and the settings that would.
    """
    per = tensor_parallel * stages
    if not data_parallel:
        if devices % per:
            degrees = (f"tensor_parallel × pipeline_stages = {tensor_parallel}×{stages} "
                       if stages > 1 else "")
            fits = ", ".join(str(d) for d in range(1, devices + 1) if devices % d == 0)
            raise ConfigError("tensor_parallel", tensor_parallel,
                              f"{degrees}must divide the {devices} {where} ({fits} do)" +
                              (f"; or use --cpu_devices=<multiple of {per}>" if cpu_hint
                               else ""))
        return devices // per
    if data_parallel * per != devices:
        setting, degrees = (
            ("pipeline_stages", f"data_parallel × tensor_parallel × pipeline_stages = "
             f"{data_parallel}×{tensor_parallel}×{stages}") if stages > 1 else
            ("data_parallel", f"data_parallel × tensor_parallel = "
             f"{data_parallel}×{tensor_parallel}"))
        fixes = ([f"--cpu_devices={data_parallel * per} on CPU"] if cpu_hint else []) + (
            [f"--data_parallel={devices // per}"] if devices % per == 0 else [])
        raise ConfigError(setting, stages if stages > 1 else data_parallel,
                          f"{degrees} = {data_parallel * per} must equal the {devices} "
                          f"{where}" + (f"; use {', or '.join(fixes)}" if fixes else ""))
    return data_parallel


def check_devices(config, processes=1):
    """Before TensorFlow: a DTensor mesh's degrees against the logical CPUs of one process
    (`cpu_devices > 1`), by `mesh_degrees`. Across several processes (`processes > 1`) or
    on real devices (`cpu_devices` 0 or 1) the count is known only once TensorFlow lists
    the devices: `tfpar.layout` checks it then. (GPUs, when present, are the mesh's
    devices: `--cpu_devices` is for CPU-only hosts.)

    Raises:
        ConfigError: naming the degree that does not fit, and the settings that would.
    """
    if backend_of(config) != "dtensor" or processes > 1 or config.cpu_devices < 2:
        return
    mesh_degrees(config.data_parallel, config.tensor_parallel, config.pipeline_stages,
                 config.cpu_devices, f"logical CPUs of --cpu_devices={config.cpu_devices}")
