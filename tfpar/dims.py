"""The parallel degrees of a run, in one value object checked once (torchtitan's
`ParallelDims` is the model). Imports no TensorFlow.

`ParallelDims` holds data (`dp`), tensor (`tp`) and pipeline (`pp`) degrees, virtual stages
per device, micro-batches, the devices the layout fills and the worker processes they live
on. Every other part reads the degrees from it instead of re-deriving them: the strategy's
replicas (`replicas`), the meshes (`on_devices`, `stage_groups`; `tfpar.layout.mesh`,
`tfpar.layout.pipeline`, `tfpar.layout.multi_client`), the pipeline across workers
(`tfpar.compat`'s cluster rows) and the planner (`layouts`). Branches read its properties
(`pp_enabled`, `tp_enabled`, ...), never `pipeline_stages > 1`.

>>> dims = ParallelDims(dp=0, tp=2, pp=2).on_devices(8)
>>> dims.dp, dims.pp_enabled, dims.stage_groups(list("abcdefgh"))
(2, True, [['a', 'b', 'c', 'd'], ['e', 'f', 'g', 'h']])
"""

import dataclasses
import math

from tfpar.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """The degrees of one layout.

    Args:
        dp: data-parallel replicas (per stage); 0 = what `tp` × `pp` leave of `devices`
            (resolved by `on_devices` or `replicas`).
        tp: tensor-parallel degree (the mesh's `model` axis).
        pp: pipeline stages.
        virtual: model chunks per stage (the interleaved schedule), else 1.
        microbatches: micro-batches of a pipelined step.
        devices: devices the layout fills, over all workers (0 = not known yet: before
            TensorFlow lists them).
        workers: processes the devices live on.

    Raises:
        ConfigError: a degree out of range, naming it.
    """

    dp: int = 0
    tp: int = 1
    pp: int = 1
    virtual: int = 1
    microbatches: int = 1
    devices: int = 0
    workers: int = 1

    def __post_init__(self):
        for name, low in (("tp", 1), ("pp", 1), ("virtual", 1), ("microbatches", 1),
                          ("workers", 1), ("dp", 0), ("devices", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(_SETTINGS[name], value, f"must be an integer >= {low}")

    @classmethod
    def from_config(cls, config, devices=0, workers=1):
        """The degrees a `ParallelConfig` asks for (`virtual` only with the interleaved
        schedule), on `devices` devices of `workers` processes when known."""
        return cls(dp=config.data_parallel, tp=config.tensor_parallel,
                   pp=config.pipeline_stages,
                   virtual=config.virtual_stages if config.schedule == "interleaved" else 1,
                   microbatches=config.microbatches, devices=devices, workers=workers)

    # What is on: branches read these, never the raw degrees.
    @property
    def dp_enabled(self):
        return self.dp > 1

    @property
    def tp_enabled(self):
        return self.tp > 1

    @property
    def pp_enabled(self):
        return self.pp > 1

    @property
    def interleaved(self):
        return self.pp_enabled and self.virtual > 1

    @property
    def stage_models(self):
        """Stage models of a pipeline: stages × virtual stages."""
        return self.pp * self.virtual

    @property
    def per_stage(self):
        """Devices of one stage's mesh: dp × tp (dp resolved)."""
        return self.dp * self.tp

    def on_devices(self, devices, where="local devices", cpu_hint=True):
        """These degrees filling exactly `devices` devices, `dp=0` resolved: `pp` meshes
        of `dp` × `tp`. One rule for the check before TensorFlow (`tfpar.compat.
        check_devices`) and the meshes built after it. `where` names the devices in the
        message ("local devices", "logical CPUs of --cpu_devices=4", ...); `cpu_hint=False`
        where `--cpu_devices` is not the count (devices of several processes).

        Raises:
            ConfigError: naming the degree that does not fit, and the settings that would.
        """
        dp, tp, stages = self.dp, self.tp, self.pp
        per = tp * stages
        if not dp:
            if devices % per:
                degrees = (f"tensor_parallel × pipeline_stages = {tp}×{stages} "
                           if stages > 1 else "")
                fits = ", ".join(str(d) for d in range(1, devices + 1) if devices % d == 0)
                raise ConfigError("tensor_parallel", tp,
                                  f"{degrees}must divide the {devices} {where} ({fits} do)" +
                                  (f"; or use --cpu_devices=<multiple of {per}>" if cpu_hint
                                   else ""))
            return dataclasses.replace(self, dp=devices // per, devices=devices)
        if dp * per != devices:
            setting, degrees = (
                ("pipeline_stages", f"data_parallel × tensor_parallel × pipeline_stages = "
                 f"{dp}×{tp}×{stages}") if stages > 1 else
                ("data_parallel", f"data_parallel × tensor_parallel = {dp}×{tp}"))
            fixes = ([f"--cpu_devices={dp * per} on CPU"] if cpu_hint else []) + (
                [f"--data_parallel={devices // per}"] if devices % per == 0 else [])
            raise ConfigError(setting, stages if stages > 1 else dp,
                              f"{degrees} = {dp * per} must equal the {devices} {where}" +
                              (f"; use {', or '.join(fixes)}" if fixes else ""))
        return dataclasses.replace(self, devices=devices)

    def replicas(self, devices):
        """The data-parallel replicas of a tf.distribute strategy on `devices` local
        devices, each replica holding a device per stage: `dp`, or `devices // pp`.

        Raises:
            ConfigError: fewer devices than replicas × stages, naming what would fit.
        """
        replicas = self.dp or max(1, devices // self.pp)
        if not self.pp_enabled and replicas > devices:
            raise ConfigError("data_parallel", replicas, f"only {devices} local device(s) "
                              f"exist; on CPU add --cpu_devices={replicas}")
        if replicas * self.pp > devices:
            raise ConfigError(
                "pipeline_stages", self.pp,
                f"{replicas} data-parallel replica(s) x {self.pp} stages need "
                f"{replicas * self.pp} devices, but {devices} exist; use "
                f"--data_parallel={max(1, devices // self.pp)} or "
                f"--cpu_devices={replicas * self.pp}")
        return replicas

    def stage_groups(self, names):
        """Stage s's consecutive `per_stage` devices of `names` (dims on `len(names)`)."""
        return [list(names[s * self.per_stage:(s + 1) * self.per_stage])
                for s in range(self.pp)]

    def per_worker_stage(self):
        """Devices each worker gives one stage's mesh when every stage spans all
        `workers` (`tfpar.layout.multi_client.stage_meshes`).

        Raises:
            ConfigError: a stage's mesh does not split evenly over the workers.
        """
        if self.per_stage % self.workers:
            raise ConfigError("data_parallel", self.dp,
                              f"each stage's mesh spans all {self.workers} processes, so "
                              f"data_parallel × tensor_parallel = {self.per_stage} must be a "
                              f"multiple of {self.workers}")
        return self.per_stage // self.workers

    def fits(self, devices):
        """True when these degrees fill `devices` devices of `workers` processes
        (`on_devices`, and `per_worker_stage` across processes) without a `ConfigError`."""
        try:
            resolved = self.on_devices(devices, cpu_hint=False)
            if self.workers > 1:
                resolved.per_worker_stage()
        except ConfigError:
            return False
        return True

    def for_world(self, devices, workers):
        """The layouts to try, best first, when a job written for these degrees restarts
        on `devices` devices of `workers` processes (an elastic launch that lost or gained
        workers): the model-parallel degrees kept if they fit (`tp` × `pp` divides the
        devices, `dp` = what they leave), else the largest `tp'` × `pp'` that fits (`tp'`
        a divisor of `tp`, so the presets' splits still divide; `pp'` <= `pp`; ties to
        the larger `tp'`), `dp` always what is left. Each divides the devices and splits
        every stage's mesh evenly over the processes; the caller checks the rest (the
        rulebook). Resolved `ParallelDims`."""
        out = []
        shapes = sorted(((t, p) for t in _divisors(self.tp) for p in range(self.pp, 0, -1)),
                        key=lambda tp: (-tp[0] * tp[1], -tp[0]))
        for t, p in shapes:
            dims = dataclasses.replace(self, dp=0, tp=t, pp=p, devices=0, workers=workers)
            if devices % (t * p) == 0 and dims.fits(devices):
                out.append(dims.on_devices(devices, cpu_hint=False))
        return out

    @staticmethod
    def layouts(devices):
        """Every `(dp, tp, pp)` whose product is `devices` (the planner's grid), as
        resolved `ParallelDims`, tensor degree first."""
        return [ParallelDims(dp=devices // (tp * pp), tp=tp, pp=pp, devices=devices)
                for tp in _divisors(devices) for pp in _divisors(devices // tp)]


_SETTINGS = {"dp": "data_parallel", "tp": "tensor_parallel", "pp": "pipeline_stages",
             "virtual": "virtual_stages", "microbatches": "microbatches",
             "devices": "devices", "workers": "workers"}


def _divisors(n):
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
