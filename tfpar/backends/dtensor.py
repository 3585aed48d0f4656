"""`tensor_parallel > 1`: Keras 3 on a DTensor mesh (`tfpar.layout`).

A `batch` × `model` mesh from `data_parallel` × `tensor_parallel`, the model's layout
presets, the exact stateless step of `MeshTrainer` (with bf16/fp16 mixed precision and
in-step gradient accumulation); global batches from `tfpar.data` split on the `batch` axis.

Under a `TF_CONFIG` of several training processes (`python -m tfpar.launch --workers=2 --
python -m tfpar.train --tensor_parallel=2 --data_parallel=2 --cpu_devices=2`), each process
is a DTensor client (`tfpar.layout.multi_client` sets `DTENSOR_*` from `TF_CONFIG`) and the
mesh spans all of them, row-major: the model axis inside a process, the batch axis across.
Every process reads the same global batches and packs only its own devices' shards; the
chief alone writes the metrics JSON. With `--pipeline_stages>1` there (`--cpu_devices=4
--data_parallel=2 --tensor_parallel=2 --pipeline_stages=2` on 2 workers) each stage's mesh
spans every process too (`multi_client.stage_meshes`: stage s on each process's s-th group
of devices), and `layout.pipeline` runs on those meshes unchanged.
"""

import math
import os
import sys
import types

from absl import logging

from tfpar import (checkpoint, compat, data, devices, faults, memory, metrics, optimizers,
                   patches, preemption, strategy, tf_config)
from tfpar.backends import Backend, tensorboard_dir
from tfpar.callbacks import TensorBoard
from tfpar.dims import ParallelDims
from tfpar.errors import TfparError
from tfpar.layout import multi_client, pipeline, run, values
from tfpar.pipeline import schedule
from tfpar.layout.mesh import describe, make_mesh, no_all_reduce_combining


class DTensorBackend(Backend):
    """Tensor (and data) parallelism on one DTensor mesh (see the module docstring)."""

    trainer = None  # the MeshTrainer of build_model

    def build_runtime(self, config, environ=None, runtime=None):
        """A runtime over the mesh (`runtime.strategy` is the mesh); `runtime`, if given,
        must come from an earlier call of this backend."""
        optimizers.set_policy(config.mixed_precision)  # also on a runtime handed in
        if runtime is not None:
            if not hasattr(runtime, "mesh"):
                raise TfparError("train(runtime=...): a tf.distribute runtime cannot run "
                                 "--tensor_parallel>1; omit runtime")
            return runtime
        cluster = tf_config.load(os.environ if environ is None else environ)
        compat.check_cluster(config, cluster)  # a --strategy it contradicts, an evaluator
        dims = ParallelDims.from_config(
            config, workers=cluster.num_workers if cluster is not None else 1)
        if config.zero_stage == 3:  # before DTensor starts (tfpar.layout.mesh)
            no_all_reduce_combining("zero_stage", 3, "ZeRO-3 would keep every layer's whole "
                                    "gradient until one merged reduction")
            patches.no_function_constant_folding()  # else an OOM may end in SIGSEGV
        if dims.workers > 1:
            if dims.pp_enabled:  # before DTensor starts (tfpar.layout.pipeline)
                no_all_reduce_combining("pipeline_stages", dims.pp,
                                        "a mesh pipeline's step could hang")
            # Every training process of TF_CONFIG is a DTensor client; the mesh spans them.
            cluster = multi_client.initialize(config.cpu_devices, environ)
            # A SIGTERM from here to the run's PreemptionGuard (`tfpar.launch` sends it as
            # soon as every worker is ready) saves and stops at the first agreed step.
            preemption.hold_sigterm(bool(config.checkpoint_dir))
        else:
            devices.split_cpu(config.cpu_devices)
        meshes = _meshes(dims)
        index, chief = ((cluster.worker_index, cluster.is_chief) if dims.workers > 1
                        else (0, True))
        runtime = types.SimpleNamespace(strategy=meshes[0], mesh=meshes[0],
                                        replicas=meshes[0].shape[0], workers=dims.workers,
                                        worker_index=index, is_chief=chief, meshes=meshes)
        print(strategy.READY_LINE, file=sys.stderr, flush=True)  # tfpar.launch waits for it
        return runtime

    def build_model(self, config, runtime, task):
        meshes = runtime.meshes if config.dims.pp_enabled else runtime.mesh
        _, model, self.trainer = run.build(config, task, meshes)
        logging.info("%s; %d/%d parameters per device", "; ".join(
            describe(m) for m in runtime.meshes), _shard_sizes(runtime, model)[0],
            model.count_params())
        return model

    def fit(self, config, runtime, model, task, recorder, callbacks):
        callbacks = [recorder, *callbacks]
        start, checkpointer, guard = 0, None, None
        if config.checkpoint_dir:
            checkpointer = checkpoint.Checkpointer(config, model, runtime)
            start = checkpointer.restore()
            # SIGTERM: the workers agree on a step over the mesh, save it and stop.
            guard = preemption.PreemptionGuard(checkpointer, runtime.mesh, runtime.workers)
            callbacks += [checkpointer, guard]  # in this order: the guard saves the step done
        fault = faults.injector(start)  # tests and tools/bench_faults.py: a worker killed
        if fault is not None:
            callbacks.append(fault)
        if config.tensorboard_dir:
            callbacks.append(MeshTensorBoard(tensorboard_dir(config, runtime), self.trainer,
                                             _pipeline_block(config, runtime),
                                             update_freq="epoch"))
        # Any global batch: uneven shares padded and weighted (tfpar.replica_split); the
        # mesh pipeline's stages (each mesh `batch` × `model`) share the batch axis.
        parts = runtime.mesh.shape[0]
        batches = iter(data.mesh_dataset(config, task, parts, start))
        validation = {}
        if config.validation_steps:  # (a --dataset function has held-out data only then)
            validation = {"validation_data": data.mesh_dataset(config, task, parts,
                                                               validation=True),
                          "validation_steps": config.validation_steps}
        self._memory_start = memory.reset_peaks(_mesh_devices(runtime))
        step = start
        while step < config.steps:
            epoch, length = step // config.steps_per_epoch, min(
                config.steps_per_epoch - step % config.steps_per_epoch, config.steps - step)
            self.trainer.fit(batches, initial_epoch=epoch, epochs=epoch + 1,
                             steps_per_epoch=length, callbacks=callbacks,
                             verbose=config.verbose, **validation)
            bad = [v for v in recorder.batch_losses if not math.isfinite(v)]
            if bad:
                raise TfparError(f"loss became {bad[0]} (on_nan={config.on_nan}); lower "
                                 "--learning_rate or check the data")
            step += length
            if model.stop_training:
                break
        if checkpointer is not None:
            guard.restore_handler()
            if start < config.steps:
                checkpointer.save()
            checkpointer.wait()  # the process ends only with its last save published
        out = {"resumed_from_step": start}
        if guard is not None and guard.preempted:
            out["preempted"] = True  # `tfpar.train` exits 143
        return out

    def stats(self, config, runtime, model, task, recorder):
        comm = mesh_comm_stats(self.trainer)
        if config.zero_stage == 3:
            comm = metrics.zero3_comm_stats(model, runtime.mesh.shape[0],
                                            self.trainer.reduction)
        result = metrics.summarize(config, runtime, recorder, _shard_sizes(runtime, model),
                                   comm=comm,
                                   pipeline=_pipeline_block(config, runtime))
        mesh_devices = _mesh_devices(runtime)
        stages = getattr(model, "stages", None) or [model]
        stage_optimizers = getattr(self.trainer, "stage_optimizers", None) or [
            self.trainer.optimizer]
        K = len(runtime.meshes)  # a pipeline: stage model v on mesh v % K
        per_mesh = len(mesh_devices) // K

        def per_device(variable_lists):  # each mesh's shards on its own devices
            return [b for s in range(K) for b in memory.shard_bytes_per_device(
                [v for variables in variable_lists[s::K] for v in variables],
                mesh_devices[s * per_mesh:(s + 1) * per_mesh])]
        result["memory"].update(memory.memory_block(
            model, getattr(self, "_memory_start", None), mesh_devices,
            param_bytes=per_device([stage.weights for stage in stages]),
            optimizer_state_bytes=per_device([o.variables for o in stage_optimizers])))
        result["strategy"] = "DTensorMesh"
        result["mesh"] = {"data_parallel": runtime.mesh.shape[0],
                          "tensor_parallel": runtime.mesh.shape[1]}
        if len(runtime.meshes) > 1:
            result["mesh"]["pipeline_stages"] = len(runtime.meshes)
        return result


def _pipeline_block(config, runtime):
    """The metrics JSON's `pipeline` block of a mesh pipeline (theory only), else None."""
    if len(runtime.meshes) == 1:
        return None
    dims = config.dims
    return schedule.pipeline_metrics(config.schedule, dims.pp, dims.microbatches,
                                     dims.virtual)


def mesh_comm_stats(trainer):
    """The metrics JSON's `comm` block of a mesh step whose `batch` reduction runs a codec
    (`metrics.reductions_comm_stats` of the trainer's reductions; a pipeline's, every
    stage's), else None."""
    return metrics.reductions_comm_stats(
        getattr(trainer, "reductions", None) or [trainer.reduction])


class MeshTensorBoard(TensorBoard):
    """`tfpar.callbacks.TensorBoard` on a `MeshTrainer`'s run (`--tensorboard_dir`): the
    step count and loss scale of the trainer's optimizer (a mesh pipeline's last stage,
    whose scale every stage follows), the bytes of its `batch` reduction
    (`mesh_comm_stats`), a mesh pipeline's schedule bubble."""

    def __init__(self, log_dir, trainer, pipeline_block=None, **kwargs):
        super().__init__(log_dir, **kwargs)
        self.trainer, self.pipeline_block = trainer, pipeline_block

    def _optimizer(self):
        stages = getattr(self.trainer, "stage_optimizers", None)
        return stages[-1] if stages else self.trainer.optimizer

    def _comm(self):
        return mesh_comm_stats(self.trainer)

    def _bubble(self):
        return self.pipeline_block["bubble_theory"] if self.pipeline_block else None


def _meshes(dims):
    """The run's meshes from its degrees: one per pipeline stage (dp × tp × pp), or one;
    across processes each spans every one of them (`tfpar.layout.multi_client`)."""
    if dims.workers > 1:
        return multi_client.stage_meshes(dims.dp, dims.tp, dims.pp)
    if dims.pp_enabled:
        return pipeline.make_meshes(dims.dp, dims.tp, dims.pp, devices.compute_devices())
    return [make_mesh(dims.dp, dims.tp)]


def _mesh_devices(runtime):
    """The meshes' devices (one mesh per pipeline stage), each in DTensor's shard order
    (`dtensor.unpack`)."""
    return [str(d) for mesh in runtime.meshes for d in mesh.backend_mesh.local_devices()]


def _shard_sizes(runtime, model):
    """Parameters each device holds: per stage's mesh, the shards of its stage models."""
    stages = getattr(model, "stages", None)
    if len(runtime.meshes) == 1 or stages is None:
        return values.shard_sizes(model.weights)
    return [n for s in range(len(runtime.meshes))
            for n in values.shard_sizes([w for stage in model.on_mesh(s)
                                         for w in stage.weights])]
