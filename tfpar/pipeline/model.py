"""`PipelineModel`: a keras.Model whose `train_step` runs a pipeline schedule.

`compile`, `fit`, `evaluate`, `predict`, `save_weights` and `load_weights` work as for
any Keras model. Training splits each batch into micro-batches and runs the executor;
evaluation and prediction run the stages in sequence on the whole batch.

Examples:
    >>> tfpar.devices.split_cpu(2)
    >>> pm = PipelineModel.split(model, stages=2, schedule="1f1b", microbatches=4)
    >>> pm.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    >>> pm.fit(x, y, batch_size=32, epochs=2)
"""

import keras
import tensorflow as tf

from tfpar import patches
from tfpar.errors import ConfigError
from tfpar.pipeline import schedule as schedule_lib
from tfpar.pipeline.executor import PipelineExecutor, default_devices
from tfpar.pipeline.partition import partition
from tfpar.pipeline.placement import current_device, variables_on
from tfpar.pipeline.probe import BubbleProbe, timeline_block


@keras.saving.register_keras_serializable(package="tfpar")
class PipelineModel(keras.Model):
    """Stage models trained with a pipeline schedule.

    Args:
        stages: K*V built keras models; virtual stage v = c*K + s runs on device s. Their
            variables should already live on their stage's device (see `split`).
        schedule: 'gpipe', '1f1b', 'interleaved', 'zb_h1' (zero bubble) or 'chimera'
            (two pipelines in opposite directions: `stages` holds K stage models, then
            their copies for the second pipeline, copy K + s on device s holding virtual
            stage K - 1 - s; `split` builds them).
        microbatches: M, micro-batches per training batch; must divide the batch size.
        virtual_stages: V, model chunks per stage (interleaved only; 1 otherwise).
        devices: K placements: device names, or per stage one device per replica of
            the current strategy (`tfpar.pipeline.placement`); default the first K local
            devices.
        recompute: recompute each stage's forward during its backward.
        measure_bubble: profile one step of the first `fit` (`tfpar.pipeline.probe`) and
            report its idle fraction as `bubble_measured`.
        grad_accum_steps: k, runs of the schedule per step (each on `microbatches`
            micro-batches) before one update; every batch must split into k·M.
    Attributes:
        stages: the stage models; `stage_optimizers`: after `compile`, one optimizer per
            stage holding its slots on the stage's device(s). Both are checkpointed with
            the model (`tf.train.Checkpoint(model=...)`). After a `fit` of 3 steps or
            more: `bubble_measured` and `measured_timeline` (None before).
    Raises:
        ConfigError: sizes that do not fit together (stages vs K*V, M vs schedule,
            too few devices).

    Examples:
        >>> import numpy as np, keras, tfpar
        >>> _ = tfpar.make_strategy("one_device", cpu_devices=2)  # two CPU devices, one per stage
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
        ...                           keras.layers.Dense(1)])
        >>> pipeline = tfpar.PipelineModel.split(model, stages=2, schedule="1f1b", microbatches=2)
        >>> pipeline.compile(optimizer="sgd", loss="mse")
        >>> x = np.ones((16, 4), "float32")
        >>> pipeline.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0).history["loss"][0] > 0
        True
    """

    def __init__(self, stages, schedule="1f1b", microbatches=1, virtual_stages=1,
                 devices=None, recompute=False, measure_bubble=True, grad_accum_steps=1,
                 **kwargs):
        super().__init__(**kwargs)
        if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ConfigError("grad_accum_steps", grad_accum_steps, "must be an integer >= 1")
        V = virtual_stages if schedule == "interleaved" else 1
        if len(stages) % V:
            raise ConfigError("virtual_stages", virtual_stages,
                              f"must divide the number of stage models ({len(stages)})")
        if schedule == "chimera" and len(stages) % 2:
            raise ConfigError("stages", len(stages), "the chimera schedule takes 2·K stage "
                              "models (K stages and their copies); build it with split")
        K = len(stages) // _models_per_stage(schedule, V)
        # The stage models a micro-batch passes (Chimera: the first pipeline's).
        self._path = list(range(K)) if schedule == "chimera" else list(range(len(stages)))
        self.stages = list(stages)
        for v, stage in enumerate(self.stages):
            # Named attributes are what tf.train.Checkpoint follows (lists are not).
            setattr(self, f"stage_{v}", stage)
        self.stage_optimizers = None
        self.schedule_name, self.microbatches, self.virtual_stages = schedule, microbatches, V
        self.recompute, self.measure_bubble = recompute, measure_bubble
        self.grad_accum_steps = grad_accum_steps
        self.bubble_measured = self.measured_timeline = None
        self._probe = None
        self._devices_arg = _placements(devices) if devices else None
        self.devices = self._devices_arg or default_devices(K)
        schedule_lib.make_schedule(schedule, K, microbatches, V)  # sizes it cannot take fail here
        self._executor = None
        self.built = True  # the stages are built models

    @classmethod
    def split(cls, model, stages, schedule="1f1b", microbatches=1, virtual_stages=1,
              devices=None, costs=None, recompute=False, **kwargs):
        """Partitions `model` into `stages` (x `virtual_stages`) stage models, each built on
        its device, and wraps them. The original model is left untouched.

        Raises:
            ConfigError / TfparError: see `partition` and the constructor.
        """
        V = virtual_stages if schedule == "interleaved" else 1
        devices = _placements(devices) if devices else default_devices(stages)
        schedule_lib.make_schedule(schedule, stages, microbatches, V)  # fail before the copy
        parts = partition(model, stages * V, costs=costs,
                          devices=[devices[v % stages] for v in range(stages * V)],
                          setting="pipeline_stages" if V == 1 else "pipeline_stages*virtual_stages")
        if schedule == "chimera":  # the second pipeline's copies: virtual stage p on K-1-p
            copies = partition(model, stages, costs=costs,
                               devices=[devices[stages - 1 - p] for p in range(stages)])
            parts += copies[::-1]
        return cls(parts, schedule, microbatches, V, devices, recompute, **kwargs)

    @classmethod
    def from_parallel_config(cls, model, config, devices=None):
        """`split` with the degrees of a `tfpar.ParallelConfig`."""
        return cls.split(model, config.pipeline_stages, config.schedule, config.microbatches,
                         config.virtual_stages, devices)

    def compile(self, optimizer="rmsprop", loss=None, **kwargs):
        """As keras.Model.compile; jit_compile is forced off (XLA cannot span the stage
        devices) and the optimizer is copied once per stage onto the stage's device."""
        kwargs["jit_compile"] = False
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        # The compiled optimizer only counts steps (callbacks read `iterations`); building
        # it empty keeps Keras from placing slots for every variable on one device.
        self.optimizer.build([])
        loss_fn = keras.losses.get(loss) if isinstance(loss, str) else loss
        if not isinstance(loss_fn, keras.losses.Loss):
            # A Loss reduces to the mean and divides by the replicas, as Keras's own
            # train_step expects of the loss whose gradients are all-reduced as a sum.
            loss_fn = patches.function_loss(loss_fn)
        # Built here, not kept from __init__: Keras would wrap an attribute's lists in its
        # own (losing a `BidirectionalSchedule`'s type, which says which way chunks run).
        schedule = schedule_lib.make_schedule(self.schedule_name, len(self.devices),
                                              self.microbatches, self.virtual_stages)
        self._executor = PipelineExecutor(self.stages, self.devices, schedule,
                                          loss_fn, recompute=self.recompute,
                                          grad_accum_steps=self.grad_accum_steps)
        self.stage_optimizers = self._executor.build_optimizers(self.optimizer)
        for s, opt in enumerate(self.stage_optimizers):  # checkpointed with the model
            setattr(self, f"stage_{s}_optimizer", opt)

    def compile_from_config(self, config):
        self.compile(**keras.saving.deserialize_keras_object(config))

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """As keras.Model.fit; first checks that every batch splits into micro-batches.

        Raises:
            ConfigError: `microbatches` does not divide the batch size, or the last,
                smaller batch of an array input.
        """
        n = getattr(x, "shape", (None,))[0]
        size = batch_size or (32 if n is not None else None)
        if size is not None:
            sizes = {size} | ({n % size} if n and not kwargs.get("validation_split") else set())
            count = self.microbatches * self.grad_accum_steps
            for b in sorted(sizes - {0}):
                if b % count:
                    raise ConfigError(
                        "microbatches", self.microbatches,
                        f"must divide every batch (times grad_accum_steps="
                        f"{self.grad_accum_steps}), but batch_size={size} over {n} examples "
                        f"gives a batch of {b}; pick sizes that are multiples of {count}")
        if self.measure_bubble and self.bubble_measured is None:
            if self._probe is None:  # one probe over all fit calls: it counts their steps
                self._probe = BubbleProbe(len(self.devices))
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self._probe]
        return super().fit(x, y, batch_size, *args, **kwargs)

    def call(self, x, training=False):
        for v in self._path:
            with tf.device(current_device(self.devices[v % len(self.devices)])):
                x = self.stages[v](x, training=training)
        return x

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, y_pred = self._executor.train_step(x, y, sample_weight)
        self.optimizer.iterations.assign_add(1)
        # The executor's loss is divided by the replicas (see `_FunctionLoss`); the tracker
        # shows the loss of the whole batch, as Keras's own train_step does.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        self._loss_tracker.update_state(loss * tf.cast(replicas, loss.dtype),
                                        sample_weight=tf.shape(x)[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def pipeline_metrics(self, bubble_measured=None):
        """The `pipeline` block of the metrics JSON: stages, micro-batches, schedule,
        the theoretical bubble and the peak stashed micro-batches of the schedule's
        simulation; `bubble_measured` (the caller's, else the sampled step's) and
        `timeline_measured` when a step was measured."""
        K = len(self.devices)
        if bubble_measured is None:
            bubble_measured = self.bubble_measured
        block = schedule_lib.pipeline_metrics(self.schedule_name, K, self.microbatches,
                                              self.virtual_stages, bubble_measured)
        if self.measured_timeline is not None:
            block["timeline_measured"] = timeline_block(self.measured_timeline)
        return block

    def copied_weights(self):
        """The weights of Chimera's second pipeline (stage models K..2K-1): copies of the
        first's, their trainable weights equal to them after every step (a checkpoint holds
        each once, `tfpar.state`); empty for other schedules. A layer's non-trainable state
        (BatchNormalization's moving statistics) is not kept equal: each copy moves its own
        on its half of the micro-batches, and `predict` and checkpoints use the first's."""
        K = len(self.devices)
        return [w for stage in self.stages[K:] for w in stage.weights] \
            if self.schedule_name == "chimera" else []

    def updated_variables(self):
        """The trainable variables the stage optimizers update, each summed over the
        replicas once per step: all but Chimera's second-pipeline copies, which take
        their first copy's new weights instead (`PipelineExecutor`)."""
        if self._executor is None:
            return list(self.trainable_variables)
        return [v for s in range(len(self.devices)) for v in self._executor.stage_variables(s)]

    def params_per_stage(self):
        """Parameter count each stage's device holds (all its chunks)."""
        K = len(self.devices)
        return [sum(self.stages[v].count_params() for v in range(s, len(self.stages), K))
                for s in range(K)]

    def get_config(self):
        config = super().get_config()
        config.update(
            stages=[keras.saving.serialize_keras_object(s) for s in self.stages],
            schedule=self.schedule_name, microbatches=self.microbatches,
            virtual_stages=self.virtual_stages, devices=self._devices_arg,
            recompute=self.recompute, measure_bubble=self.measure_bubble,
            grad_accum_steps=self.grad_accum_steps)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        V = config.get("virtual_stages", 1)
        K = len(config["stages"]) // _models_per_stage(config.get("schedule"), V)
        devices = _placements(config.get("devices")) or default_devices(K)
        stages = []
        for v, stage in enumerate(config.pop("stages")):
            with variables_on(devices[v % K]):  # variables are created on the stage's device
                stages.append(keras.saving.deserialize_keras_object(stage))
        return cls(stages, **config)


def _models_per_stage(schedule, virtual_stages):
    """Stage models each stage holds: V (interleaved), 2 (chimera's two directions), 1."""
    return 2 if schedule == "chimera" else virtual_stages


def _placements(devices):
    """Device names stay names; per-replica lists (e.g. read back from JSON) become
    tuples."""
    if not devices:
        return None
    return [d if isinstance(d, str) else tuple(d) for d in devices]
