"""`for_training`: the trainer's way in. Splits a model into a `PipelineModel` whose
stages sit on the devices left over by the data-parallel strategy.

Device layout: the strategy's R replicas run on its R "lead" devices; those lead the
stage-0 work of each replica. Replica r's stage s >= 1 runs on the s-th group of R
devices the strategy does not use: with 4 logical CPUs, R=2 over CPU:0 and CPU:1, K=2,
replica 0 runs its stages on CPU:0, CPU:2 and replica 1 on CPU:1, CPU:3.
"""

from tfpar import devices as devices_lib
from tfpar import tf_config
from tfpar.dims import ParallelDims
from tfpar.errors import ConfigError
from tfpar.pipeline import remote
from tfpar.pipeline.model import PipelineModel


def stage_placements(lead_devices, all_devices, stages):
    """Per stage, one device per replica (see the module docstring).

    Args:
        lead_devices: the strategy's replica devices, in replica order.
        all_devices: every local compute device.
        stages: K.
    Returns:
        K tuples of len(lead_devices) device names.
    Raises:
        ConfigError: fewer than K * R devices (`ParallelDims.replicas`).
    """
    R = ParallelDims(dp=len(lead_devices), pp=stages).replicas(len(all_devices))
    canon = lambda d: d.split("/device:")[-1].upper()  # noqa: E731
    leads = {canon(d) for d in lead_devices}
    spare = [d for d in all_devices if canon(d) not in leads]
    return [tuple(lead_devices)] + [tuple(spare[(s - 1) * R:s * R]) for s in range(1, stages)]


def for_training(model, config, runtime):
    """`model` as a `PipelineModel` of `config.pipeline_stages` stages, for `fit` under
    `runtime.strategy`. Call inside `runtime.strategy.scope()`, before `compile`.

    Stage variables (and, after compile, their optimizer slots) are created on the stage
    devices; with R > 1 replicas they are mirrored per stage across the replicas and their
    gradients all-reduced per stage by the strategy.

    Args:
        model: a built plain Keras model (Sequential or a functional chain of blocks).
        config: the `ParallelConfig` (pipeline_stages, microbatches, schedule,
            virtual_stages, grad_accum_steps).
        runtime: the `tfpar.strategy.Runtime` whose strategy the model trains under.
    Returns:
        a `PipelineModel` (uncompiled); `model.pipeline_metrics()` gives the metrics
        JSON's `pipeline` block.
    Raises:
        ConfigError: a runtime that cannot hold the pipeline, a `--dataset` function's
            batch the replicas or micro-batches do not split, too few devices. (Settings
            that do not combine with the pipeline were refused when `config` was built:
            `tfpar.compat`.)
    """
    K = config.pipeline_stages
    if runtime.kind == "multi_worker":
        # tfpar.backends.distribute builds a `remote.KIND` runtime for a pipelined
        # TF_CONFIG job; a multi-worker strategy here came from the caller.
        raise ConfigError(
            "strategy", "multi_worker",
            "a pipeline across workers runs from one client (worker 0), not under "
            "MultiWorkerMirroredStrategy; let tfpar.train build the runtime (no runtime=)")
    if config.dataset != "auto":
        # A --dataset function yields equal per-replica batches, cut as they come; the
        # generated data pads each replica's share to whole micro-batches instead
        # (`tfpar.data.pipeline_dataset`, `ParallelConfig.replica_split`).
        per_replica = config.per_replica_batch(
            runtime.replicas, "a --dataset function yields equal per-replica batches")
        if per_replica % config.microbatches:
            raise ConfigError(
                "microbatches", config.microbatches,
                f"must divide the per-replica batch of {per_replica} "
                f"(global_batch_size={config.global_batch_size} over {runtime.replicas} "
                f"replicas) of a --dataset function")
    leads = list(runtime.strategy.extended.worker_devices)
    across_workers = runtime.kind == remote.KIND
    if across_workers:  # stage s on worker s, replica r on each worker's device r
        placements = remote.worker_stage_devices(tf_config.load(), K, runtime.replicas)
    else:
        placements = stage_placements(leads, devices_lib.compute_devices(), K)
    if runtime.replicas == 1:
        placements = [p[0] for p in placements]
    # The profiler sees this process's ops only: across workers the bubble is not measured
    # (the metrics JSON then has bubble_theory and no bubble_measured).
    return PipelineModel.split(model, K, config.schedule, config.microbatches,
                               config.virtual_stages, devices=placements,
                               recompute=config.recompute == "full",
                               name=f"{model.name}_pipeline",
                               measure_bubble=not across_workers,
                               grad_accum_steps=config.grad_accum_steps)
