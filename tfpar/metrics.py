"""Run metrics: step times, per-step loss, throughput, memory, and the metrics JSON.

The metrics JSON (`--metrics_json=PATH`) is one shape that benchmarks, `tfpar.report` and
outside checks read; keys that do not apply to a run are omitted:

    {"config": {...every ParallelConfig setting...}, "strategy": str, "replicas": int,
     "workers": int, "steps": int, "final_loss": float, "loss_history": [float, ...],
     "examples_per_sec": float, "step_time_ms": {"median": float, "p90": float},
     "cpu_kernels": "onednn" | "eigen",
     "comm": {"bytes_on_wire_per_step": int, "bytes_uncompressed_per_step": int,
              "compression_ratio": float, "comm_time_fraction": float,
              "overlap_fraction": float, "hidden_fraction": float,
              "comm_busy_ms": float, "backward_end_ms": float,
              "allreduce": "flat" | "hierarchical" | "hierarchical_leader"},
     "pipeline": {"stages": int, "microbatches": int, "schedule": str,
                  "bubble_measured": float, "bubble_theory": float,
                  "peak_stashed_microbatches": int},
     "memory": {"peak_rss_mb": float, "params_per_device": [int, ...],
                "devices": [str, ...], "peak_bytes_per_device": [int, ...] | null,
                "peak_bytes_scope": "process" | "device",
                "peak_bytes_above_start_per_device": [int, ...],
                "param_bytes_per_device": [int, ...],
                "optimizer_state_bytes_per_device": [int, ...]}}

`loss_history` holds each step's own loss as its train step computed it (the batch logs'
`step_loss`, `report_step_loss`): the mean over the step's replicas and micro-batches.

`memory`'s per-device lists follow `memory.devices` (`tfpar.memory` says what each figure
means; on CPU logical devices share one allocator, so `peak_bytes_scope` is "process").

`offload` (with `--offload=optimizer`, `tfpar.offload.stats`): `{"mode": str,
"host_state_bytes": int, "bytes_to_host_per_step": int, "bytes_to_device_per_step": int}`:
the slots held in host memory, and what one step copies over the process's local replicas
(the gradient down, the step up to every replica; on CPU both sides are the same RAM).
Its slots then count in neither `optimizer_state_bytes_per_device` nor the allocator's peak.

`cpu_kernels` is what TensorFlow ran (`tfpar.cpu_kernels.active`), whatever `--cpu_kernels`
asked for. (Added by `tfpar.train.train`, after `summarize`.)

`comm.allreduce` is how the gradients' sums crossed workers (`--allreduce`, resolved):
"flat" (tf.distribute's ring), "hierarchical" (hosts of equal replica counts: reduce-scatter
inside each host, a ring across hosts per piece, all-gather) or "hierarchical_leader"
(hosts of unequal counts, or workers of several GPUs each: through one leader a host),
`tfpar.compression.hierarchical`.

`comm_time_fraction` and `overlap_fraction` (with `--measure_comm`) are shares in [0, 1]
(`tfpar.compression.timing`). Also with `--measure_comm`, where a step runs collectives:
`hidden_fraction`, the share of the collectives' busy time before backward's end, from
timestamps inside one traced step (not from separately timed calls; busy from when every
replica could start a collective, its inputs ready: the hidden time is an upper bound; the
share usually is), with that busy time
`comm_busy_ms` and backward's end `backward_end_ms` from the step's start (medians over
the timed steps; `tfpar.overlap`). Benchmarks may add keys of their own inside these blocks
(e.g. `bench_pipeline`'s `bubble_profiled` and `timeline`); existing keys keep their
meaning.
"""

import json
import math
import os
import resource
import threading
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfpar import patches
from tfpar.compression import aggregator_of
from tfpar.errors import TfparError

# The batch logs' key holding the step's own loss (`report_step_loss`, `MeshTrainer.fit`).
STEP_LOSS = "step_loss"


def report_step_loss(model, mean=keras.metrics.Mean, direct=None):
    """Makes `model.fit`'s batch logs carry `step_loss`: the loss `model`'s train step
    computed for that batch, beside Keras's `loss` (the running mean over the epoch).

    The step's loss is what the train step hands the model's loss tracker, read where the
    step hands it over: the value itself when the step hands one (Keras's own step), the
    weighted mean of the values when it hands several (`sum(value × weight) / sum(weight)`,
    as a `Mean` emptied at the start of the step would give), over replicas and workers as
    Keras logs `loss`. That takes no variable and no state: a `Mean` of its own (emptied,
    updated and read every step) was 128 of the 169 ops the MLP's data-parallel step on 4
    replicas had beyond stock Keras's (docs/benchmarks/data_parallel.md). Values handed
    inside a nested graph (accumulation's `tf.while_loop`, a `cond`) cannot be read outside
    it: those go to a `Mean` of the step's own, emptied once read. A Keras 2 (`tf_keras`)
    model always takes the `Mean` (emptied at the start of each step); so does every value
    with `direct=False` (`tools/bench_data_parallel.py --without=direct_step_loss` times the
    two side by side). Rebuilding the step's loss from the running mean instead
    (`k*mean_k - (k-1)*mean_{k-1}`) is off by float32 rounding that grows with k (2.3e-5 by
    step 200 in `tests/test_step_loss.py`).

    Call under the strategy's scope (the `Mean` is per replica, like Keras's own metrics),
    after anything else that replaces `model.train_step` (`tfpar.accumulation.install`).

    Args:
        model: a compiled Keras 3 or tf_keras model.
        mean: the `Mean` class of the model's Keras (`tf_keras.metrics.Mean` for tf_keras:
            its `result()` sums the replicas' state as the logs expect).
        direct: read the handed values where they can be (default: for a Keras 3 model),
            or every value through the `Mean`, emptied at the start of each step.
    """
    step = mean(name=STEP_LOSS)
    tracker = patches.loss_tracker(model)
    update = tracker.update_state
    train_step = model.train_step
    if direct is None:
        direct = isinstance(model, keras.Model)
    if not direct:  # tf_keras: its Mean, emptied every step
        def update_state(values, sample_weight=None):
            step.update_state(values, sample_weight=sample_weight)
            return update(values, sample_weight=sample_weight)

        def reporting_train_step(data):
            _empty(step)
            logs = train_step(data)
            return {**logs, STEP_LOSS: step.result()}

        tracker.update_state = update_state
        model.train_step = reporting_train_step
        return

    # The step being traced, per thread: MirroredStrategy traces each replica's step in a
    # thread of its own, the replicas taking turns at every merge_call.
    tracing = threading.local()

    def update_state(values, sample_weight=None):
        frame = getattr(tracing, "frame", None)
        if frame is not None:
            if (tf.compat.v1.get_default_graph() is frame["graph"]
                    and _scalar(values) and _scalar(sample_weight)):
                frame["handed"].append((values, sample_weight))
            else:  # inside a nested graph, or not one value: the Mean adds it up
                frame["nested"] = True
                step.update_state(values, sample_weight=sample_weight)
        return update(values, sample_weight=sample_weight)

    def reporting_train_step(data):
        frame = {"graph": tf.compat.v1.get_default_graph(), "handed": [], "nested": False}
        tracing.frame = frame
        try:
            logs = train_step(data)
        finally:
            tracing.frame = None
        handed = frame["handed"]
        if frame["nested"]:
            for values, weight in handed:
                step.update_state(values, sample_weight=weight)
            loss = step.result()
            with tf.control_dependencies([loss]):  # emptied once read, for the next step
                _empty(step)
        elif len(handed) == 1:
            value, weight = handed[0]
            loss = tf.cast(value, "float32")
            if weight is not None:  # a replica's empty share: 0, as the Mean's v·w / w gave
                loss = tf.where(tf.cast(weight, "float32") > 0, loss, 0.0)
        elif handed:
            values = [tf.cast(v, "float32") for v, _ in handed]
            weights = [tf.ones([]) if w is None else tf.cast(w, "float32") for _, w in handed]
            loss = tf.math.divide_no_nan(tf.add_n([v * w for v, w in zip(values, weights)]),
                                         tf.add_n(weights))
        else:
            loss = _unhanded_loss(model, logs, step)
        return {**logs, STEP_LOSS: loss}

    tracker.update_state = update_state
    model.train_step = reporting_train_step


def _unhanded_loss(model, logs, step):
    """The step's loss when its train step handed the loss tracker nothing (a step of the
    user's own that computes its loss and returns it): the `loss` it returns if that is one
    number, else 0 (what Keras's own `loss` then logs) with a warning naming the model, said
    while the step is traced, so the metrics JSON's zeros are not taken for a loss."""
    loss = logs.get("loss") if isinstance(logs, dict) else None
    if loss is not None and _scalar(loss):
        return tf.cast(loss, "float32")
    logging.warning(
        "tfpar: the train step of model %r hands its loss tracker no value and returns no "
        "scalar 'loss': step_loss (the metrics JSON's per-step loss) is reported as 0; "
        "return {'loss': <the batch's loss>, ...} from train_step, or update "
        "the model's loss tracker", getattr(model, "name", model))
    return step.result()


def _empty(metric):
    for variable in metric.variables:
        variable.assign(tf.zeros(variable.shape, variable.dtype))


def _scalar(value):
    """Whether `value` (a tensor, a number or None) is known to hold at most one number (a
    list or tuple is not: the Mean adds it up)."""
    if value is None:
        return True
    if isinstance(value, (list, tuple)):
        return False
    return getattr(value, "shape", ()) == ()


class StepRecorder(keras.callbacks.Callback):
    """Records wall time and loss of every training batch across any number of `fit` calls.

    The loss of a batch is the `step_loss` of its logs: the loss its train step computed
    (`report_step_loss`; `tfpar.layout.MeshTrainer` logs it too). Epoch ends with
    `val_loss` in their logs (`fit(validation_data=...)`) are kept in `validation` as
    `(steps done, val_loss, val_accuracy)`.

    Raises:
        TfparError: a batch's logs have no `step_loss` (a train step that does not report
            it: Keras's running mean alone gives each batch's loss only approximately).
    """

    def __init__(self):
        super().__init__()
        self.step_seconds = []
        self.batch_losses = []
        self.validation = []
        self._begin = None

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        if "val_loss" in logs:
            self.validation.append((len(self.batch_losses), float(logs["val_loss"]),
                                    float(logs.get("val_accuracy", math.nan))))

    def on_train_batch_end(self, batch, logs=None):
        self.step_seconds.append(time.perf_counter() - self._begin)
        logs = logs or {}
        if STEP_LOSS not in logs:
            raise TfparError(f"the batch logs have no {STEP_LOSS!r} (keys: {sorted(logs)}); "
                             "a train step must report its loss with "
                             "tfpar.metrics.report_step_loss")
        self.batch_losses.append(float(logs[STEP_LOSS]))


def reductions_comm_stats(reductions):
    """The metrics JSON's `comm` block of a DTensor mesh's `batch` reductions that run a
    codec (`tfpar.layout.reduction`; a pipeline's, summed over its stages), or None when
    there are none: DTensor's own fp32 sum inside the backward is not counted, nor are the
    `model` axis's collectives. With `auto`, `comm.auto`: `r_budget` (the first stage's),
    `ranks` (every matrix's) and, in a pipeline, `r_budget_per_stage`."""
    reductions = [r for r in reductions or () if r is not None]
    if not reductions:
        return None
    stats = [r.comm_stats() for r in reductions]
    wire = sum(s["bytes_on_wire_per_step"] for s in stats)
    raw = sum(s["bytes_uncompressed_per_step"] for s in stats)
    out = {"bytes_on_wire_per_step": wire, "bytes_uncompressed_per_step": raw,
           "compression_ratio": raw / wire}
    autos = [r for r in reductions if hasattr(r, "ranks")]  # `tfpar.layout.auto`
    if autos:  # each matrix's rank now (0: exact), as tf.distribute's `comm.auto.ranks`
        out["auto"] = {"r_budget": autos[0].r_budget,
                       "ranks": {k: v for r in autos for k, v in r.ranks().items()}}
        if len(autos) > 1:  # a pipeline: each stage plans from its own matrices
            out["auto"]["r_budget_per_stage"] = [r.r_budget for r in autos]
    return out


def _keras_mesh_reductions(model):
    """The `batch` reductions of a user's `fit` on a Keras distribution's mesh: the 3D
    fit's stages' (`tfpar.layout.keras_pipeline`) or one mesh's (`keras_step`)."""
    trainer = getattr(model, "_tfpar_pipeline_trainer", None)
    if trainer is not None:
        return getattr(trainer, "reductions", None) or ()
    return getattr(model, "tfpar_reductions", None) or ()


def zero3_comm_stats(model, replicas, reduction=None):
    """The metrics JSON's `comm` block of a ZeRO-3 step with `replicas` devices on the
    mesh's `batch` axis: the weights each device hands to the per-layer gathers
    (`tfpar.zero.fsdp.gather_bytes`, in `--zero_gather`'s codec) and its gradient into
    the reduction over `batch` (whole over `batch`, split over `model` like the weight;
    fp32 into DTensor's, or with `--compression` what `reduction`, a
    `tfpar.zero.reduce_scatter.ShardedReduction`, sends: its gathers then run once a step),
    against the plain fp32 all-reduce of the gradients."""
    from tfpar.layout.mesh import MODEL
    from tfpar.zero import fsdp
    if replicas == 1:
        return None
    fp32 = 4 * sum(math.prod(v.shape) // fsdp.device_share(v, (MODEL,))
                   for v in model.trainable_variables)
    if reduction is None:
        wire = fsdp.gather_bytes(model) + fp32
    else:
        wire = (fsdp.gather_bytes(model, passes=1)
                + reduction.comm_stats()["bytes_on_wire_per_step"])
    return {"bytes_on_wire_per_step": wire, "bytes_uncompressed_per_step": fp32,
            "compression_ratio": fp32 / wire}


def _keras_zero3_comm_stats(model):
    """The `comm` block of a user's `fit` under `tfpar.layout.FullyShardedDataParallel`
    (weights split over `batch`, not a 3D fit's stages): the CLI's ZeRO-3 count
    (`zero3_comm_stats`: the per-layer gathers plus the gradient's
    reduction, fp32 into DTensor's or the codec's reduce-scatter), or None for any other
    model. Counting the reduce-scatter alone left out the gathers; counting Keras's fp32
    all-reduce without a codec left out both."""
    from tfpar.zero import fsdp
    if getattr(model, "_tfpar_pipeline_trainer", None) is not None:
        return None
    parts = fsdp.batch_parts(model.trainable_variables)
    if parts < 2:
        return None
    reductions = [r for r in _keras_mesh_reductions(model) if r is not None]
    return zero3_comm_stats(model, parts, reductions[0] if reductions else None)


def comm_stats(model, replicas):
    """The metrics JSON's `comm` block: what the optimizer's gradient aggregator handed to
    the collectives per step (a pipeline's: summed over its stages' aggregators), or Keras's
    plain fp32 all-reduce; None with one replica. On a Keras distribution's DTensor mesh a
    `DistributedOptimizer`'s codec runs in the mesh's `batch` reduction, whose bytes these
    are (`reductions_comm_stats`); its aggregator is never built there. Under
    `FullyShardedDataParallel` (ZeRO-3), the per-layer gathers' bytes and the gradient's
    reduction, as the CLI's ZeRO-3 counts them.

    Looks through a `LossScaleOptimizer` (fp16 wraps the aggregating optimizer).
    """
    zero3 = _keras_zero3_comm_stats(model)
    if zero3 is not None:
        return zero3
    mesh = reductions_comm_stats(_keras_mesh_reductions(model))
    if mesh is not None:
        return mesh
    optimizers = getattr(model, "stage_optimizers", None) or [model.optimizer]
    aggregators = [aggregator_of(o) for o in optimizers]
    if all(a is not None and getattr(a, "built", True) for a in aggregators):
        stats = [a.comm_stats() for a in aggregators]
        wire = sum(s["bytes_on_wire_per_step"] for s in stats)
        raw = sum(s["bytes_uncompressed_per_step"] for s in stats)
        # How the sums crossed hosts (`--allreduce`): a hierarchical path if any stage's took
        # one (every stage's hierarchy sees the same hosts, so the same path).
        allreduce = next((s["allreduce"] for s in stats
                          if s.get("allreduce", "flat") != "flat"), "flat")
        return {"bytes_on_wire_per_step": wire, "bytes_uncompressed_per_step": raw,
                "compression_ratio": raw / wire if wire else 1.0, "allreduce": allreduce}
    if replicas == 1:
        return None
    # A pipeline's stage optimizers sum what they update (not Chimera's second copies).
    reduced = getattr(model, "updated_variables", lambda: model.trainable_variables)()
    fp32 = 4 * sum(math.prod(v.shape) for v in reduced)
    from tfpar.zero import sharded
    zero = sharded.zero_of(model.optimizer)
    if zero is not None:
        layout = zero._tfpar_layout
        # ZeRO (tfpar.zero): the padded gradients into an all-reduce or reduce-scatter (in
        # its codec, as the step traced it), then this replica's piece of the weights into
        # the all-gather.
        wire = getattr(layout, "wire_bytes", None) or 4 * (layout.replicas + 1) * layout.piece
        return {"bytes_on_wire_per_step": wire, "bytes_uncompressed_per_step": fp32,
                "compression_ratio": fp32 / wire}
    return {"bytes_on_wire_per_step": fp32, "bytes_uncompressed_per_step": fp32,
            "compression_ratio": 1.0, "allreduce": "flat"}


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def summarize(config, runtime, recorder, params_per_device, comm=None, pipeline=None,
              warmup_batches=2):
    """The metrics dict (the shape in this module's docstring) for a finished run.

    Args:
        config: the run's `ParallelConfig`.
        runtime: the `tfpar.strategy.Runtime` it ran on.
        recorder: the `StepRecorder` that watched `fit`.
        params_per_device: parameter count held by each local device.
        comm: the aggregator's `comm_stats()` dict, if any.
        pipeline: the pipeline block, if the run was pipelined.
        warmup_batches: leading batches (tracing, first collectives) left out of timings.
    """
    loss_history = [float(v) for v in recorder.batch_losses]
    step_times = recorder.step_seconds
    timed = step_times[warmup_batches:] or step_times
    out = {
        "config": config.to_dict(),
        "strategy": type(runtime.strategy).__name__,
        "replicas": runtime.replicas,
        "workers": runtime.workers,
        "steps": len(loss_history),
        "final_loss": loss_history[-1] if loss_history else math.nan,
        "loss_history": loss_history,
    }
    if timed:
        out["examples_per_sec"] = config.effective_batch_size / float(np.mean(timed))
        out["step_time_ms"] = {"median": 1000 * float(np.median(timed)),
                               "p90": 1000 * float(np.percentile(timed, 90))}
    if comm:
        out["comm"] = dict(comm)
    if pipeline:
        out["pipeline"] = dict(pipeline)
    if recorder.validation:
        # the metrics contract's keys (the last evaluation), and every evaluation of the run.
        steps, losses, accuracies = zip(*recorder.validation)
        out["validation"] = {"loss": losses[-1], "accuracy": accuracies[-1],
                             "batches": config.validation_steps, "at_steps": list(steps),
                             "loss_history": list(losses)}
    out["memory"] = {"peak_rss_mb": peak_rss_mb(), "params_per_device": params_per_device}
    return out


def write_json(path, metrics):
    """Writes `metrics` to `path` atomically (a reader never sees half a file)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(metrics, f, indent=1)
    os.replace(tmp, path)


def summary_line(result):
    """The one line `python -m tfpar.train` prints at the end of a run."""
    parts = [f"strategy={result['strategy']}", f"replicas={result['replicas']}",
             f"workers={result['workers']}", f"steps={result['steps']}",
             f"loss {result['loss_history'][0]:.4f} -> {result['final_loss']:.4f}"
             if result["loss_history"] else "no steps run"]
    if "examples_per_sec" in result:
        parts.append(f"{result['examples_per_sec']:.0f} examples/s")
        parts.append(f"step {result['step_time_ms']['median']:.1f} ms")
    if "comm" in result:
        ratio = result["comm"]["compression_ratio"]
        # against an fp32 all-reduce of the gradients: ZeRO-3's gathers and reduce-scatter
        # can send more than that (a ratio under 1)
        relative = (f"x{ratio:.1f} smaller" if ratio >= 1 else
                    f"x{1 / ratio:.1f} an fp32 all-reduce's")
        parts.append(f"{result['comm']['bytes_on_wire_per_step'] / 1e6:.3f} MB/step on the "
                     f"wire ({relative})")
    if "validation" in result:
        parts.append(f"validation loss {result['validation']['loss']:.4f}, accuracy "
                     f"{result['validation']['accuracy']:.3f}")
    return "tfpar: " + ", ".join(parts)
