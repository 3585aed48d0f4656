"""`python -m tfpar.doctor`: finds the usual faults of a distributed setup, with the fix.

Accepts the trainer's flags (`--cpu_devices`, `--model`, `--global_batch_size`, ...), so
`python -m tfpar.doctor <the flags of your run>` checks that run. Each check prints
PASS, WARN or FAIL with what to do; the exit status is 1 when any check FAILs.

Checks: devices and topology; `TF_CONFIG` valid and peers reachable; the batch splits over
replicas × micro-batches; the learning rate is scaled for the global batch; replicas hold
the same weights and gradients after a step; communication share of a step; memory
headroom of a device (the allocator's peak of one step, else the planner's estimate,
against the device's memory, not the host's); the collective implementation and its environment.
"""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time

from absl import app, flags

from tfpar import compat
from tfpar import flags as tfpar_flags
from tfpar import tf_config as tf_config_lib
from tfpar.errors import ConfigError, TfparError

FLAGS = flags.FLAGS


def define_flags(flag_values=FLAGS):
    """The trainer's flags and the doctor's own (only `run()` calls this)."""
    tfpar_flags.define_flags(flag_values)
    if "peer_timeout_s" not in flag_values:
        define = dict(flag_values=flag_values)
        flags.DEFINE_bool("json", False, "Print the checks as JSON.", **define)
        flags.DEFINE_float("peer_timeout_s", 10.0, "Seconds to wait for each peer's port.",
                           lower_bound=0, **define)
    tfpar_flags.declare_key_flags(["json", "peer_timeout_s"], flag_values)


COMM_WARN = 0.30     # communication share of a step above which the run is comm-bound
MEMORY_WARN = 0.80   # share of device memory above which an OOM is likely


@dataclasses.dataclass
class Check:
    name: str
    status: str  # PASS | WARN | FAIL
    detail: str
    fix: str = ""

    def line(self):
        return f"{self.status:<4} {self.name}: {self.detail}" + (f" — {self.fix}" if self.fix else "")


def check_tf_config(environ=os.environ, peer_timeout=10.0):
    """`TF_CONFIG` parses, and every other task's address resolves and accepts TCP."""
    try:
        cluster = tf_config_lib.load(environ)
    except ConfigError as err:
        return Check("TF_CONFIG", "FAIL", str(err), "fix the field named above"), None
    if cluster is None:
        return Check("TF_CONFIG", "PASS", "not set: a single-worker run"), None
    unreachable = []
    for address in cluster.addresses:
        if address == cluster.own_address:
            continue
        host, port = address.rsplit(":", 1)
        if not _reachable(host.strip("[]"), int(port), peer_timeout):
            unreachable.append(address)
    if unreachable:
        return Check("TF_CONFIG", "FAIL",
                     f"{len(cluster.addresses)} tasks; no answer from {', '.join(unreachable)} "
                     f"within {peer_timeout:g}s",
                     "start those workers (or check host names, ports and firewalls); run the "
                     "doctor on every worker at once, as the job would run"), cluster
    return Check("TF_CONFIG", "PASS", f"{cluster.num_workers} workers; this is "
                 f"{cluster.task_type} {cluster.task_index}; every peer answers"), cluster


def _reachable(host, port, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, timeout))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def check_learning_rate(config):
    if config.scale_lr or config.effective_batch_size <= config.base_batch_size:
        return Check("learning rate", "PASS",
                     f"{config.scaled_learning_rate:g} for an effective batch of "
                     f"{config.effective_batch_size}")
    factor = config.effective_batch_size / config.base_batch_size
    return Check("learning rate", "WARN",
                 f"effective batch {config.effective_batch_size} is {factor:g}x "
                 f"--base_batch_size={config.base_batch_size} but the rate "
                 f"{config.learning_rate:g} is not scaled",
                 f"add --scale_lr (rate {config.learning_rate * factor:g}) with --warmup_steps, "
                 "or set --base_batch_size to the batch the rate was tuned for")


def check_batch(config, replicas):
    if _splits_any_batch(config):
        split = config.replica_split(replicas)
        if not split.even:
            low = config.global_batch_size // replicas * replicas
            fits = " or ".join(str(n) for n in (low, low + replicas) if n)
            return Check("batch split", "WARN",
                         f"{split.examples} examples a step over {replicas} replicas as "
                         f"{split.describe()}, each batch padded to {split.padded} with "
                         f"examples of weight 0 (exact; "
                         f"{split.padded * replicas / split.examples - 1:.1%} more compute)",
                         f"use --global_batch_size={fits} to compute no padding")
    need = replicas * config.microbatches * config.grad_accum_steps
    per_replica = config.global_batch_size / replicas
    if config.global_batch_size % replicas or per_replica % config.microbatches:
        good = max(need, config.global_batch_size // need * need)
        return Check("batch split", "FAIL",
                     f"global batch {config.global_batch_size} does not split over {replicas} "
                     f"replicas x {config.microbatches} micro-batches",
                     f"use --global_batch_size={good} (a multiple of {replicas * config.microbatches})")
    return Check("batch split", "PASS", f"{config.global_batch_size} = {replicas} replicas x "
                 f"{int(per_replica)} examples")


def check_replicas_in_sync(runtime, model, tolerance=0.0):
    """Every replica (on every worker) holds the same weights: checksums gathered across
    replicas agree."""
    import numpy as np
    import tensorflow as tf

    strategy = runtime.strategy
    if runtime.replicas == 1:
        return Check("replicas in sync", "PASS", "one replica")

    def checksum():
        ctx = tf.distribute.get_replica_context()
        parts = []
        for v in model.weights:
            value = tf.cast(v.value if hasattr(v, "value") else v, tf.float64)
            parts += [tf.reduce_sum(value), tf.reduce_sum(value * value)]
        del ctx
        return tf.stack(parts)[None]

    sums = strategy.gather(strategy.run(tf.function(checksum)), axis=0)
    sums = np.asarray(sums)
    spread = float(np.max(np.abs(sums - sums[:1])))
    if spread > tolerance:
        bad = sorted({int(i) for i in np.nonzero(np.any(np.abs(sums - sums[:1]) > tolerance,
                                                       axis=1))[0]})
        return Check("replicas in sync", "FAIL",
                     f"replica(s) {bad} differ from replica 0 (weight checksums differ by "
                     f"{spread:.3g})",
                     "a variable is updated outside the synchronised optimizer step (a custom "
                     "callback or layer writing per-replica state), or workers run different "
                     "code or seeds; compare them with --metrics_json")
    return Check("replicas in sync", "PASS", f"{runtime.replicas} replicas hold identical weights")


def check_communication(runtime, model, task, config, steps=5, rounds=3):
    """Share of a training step spent in the gradient all-reduce: compute-only steps vs
    steps that also all-reduce the gradients (the fastest of `rounds` interleaved rounds of
    `steps` steps each)."""
    import tensorflow as tf

    from tfpar import data

    strategy = runtime.strategy
    if runtime.replicas == 1:
        return Check("communication share", "PASS", "one replica: no gradient all-reduce"), 0.0
    batch = next(iter(data.distributed_dataset(strategy, config, task)))

    def make(reduce):
        def step(batch):
            x, y = batch[0], batch[1]
            with tf.GradientTape() as tape:
                loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            if reduce:
                grads = tf.distribute.get_replica_context().all_reduce("SUM", grads)
            return tf.add_n([tf.reduce_sum(g) for g in grads])
        return tf.function(lambda b: strategy.run(step, args=(b,)))

    # Interleaved rounds, the fastest round of each kind: another process's burst on a
    # shared machine slows a round, never speeds one up, so the minimum is the step's own cost.
    fns = {reduce: make(reduce) for reduce in (False, True)}
    for fn in fns.values():
        strategy.experimental_local_results(fn(batch))[0].numpy()
    timings = {False: float("inf"), True: float("inf")}
    for _ in range(rounds):
        for reduce, fn in fns.items():
            began = time.perf_counter()
            for _ in range(steps):
                out = fn(batch)
            strategy.experimental_local_results(out)[0].numpy()
            timings[reduce] = min(timings[reduce], (time.perf_counter() - began) / steps)
    return communication_check(timings[True], timings[False])


def communication_check(with_reduce, without):
    """`(Check, share)` from a step's seconds with the gradient all-reduce and without it:
    WARN above `COMM_WARN`, with what would help."""
    share = max(0.0, 1 - without / with_reduce)
    detail = (f"{share:.0%} of a step ({1000 * with_reduce:.1f} ms with the all-reduce, "
              f"{1000 * without:.1f} ms without)")
    if share > COMM_WARN:
        return Check("communication share", "WARN", detail,
                     "communication-bound: raise the per-replica batch or --grad_accum_steps, "
                     "or compress gradients (--compression=fp16|int8|lowbit|powersgd; see "
                     "python -m tfpar.plan)"), share
    return Check("communication share", "PASS", detail), share


def check_memory(config, replicas, memory_bytes, where="", measured=None):
    """Memory headroom of one device: the allocator's peak of one training step
    (`measured`, bytes per device) when it could be read, else the planner's estimate
    (with the run's recomputation and ZeRO stage), against the device's memory
    (`memory_bytes`, from `where`: `tfpar.memory.device_memory`)."""
    from tfpar.plan import cost, profile

    if memory_bytes is None:
        return Check("memory headroom", "WARN", f"device memory unknown ({where})")
    if measured is not None:
        need, how = measured, "measured peak of one step"
    elif config.dataset != "auto":
        return Check("memory headroom", "PASS", "custom dataset: not estimated")
    else:
        prof = profile.builtin_profile(config.model, config.model_width, config.model_depth)
        candidate = cost.Candidate(
            replicas, config.tensor_parallel, config.pipeline_stages,
            config.microbatches if config.dims.pp_enabled else config.grad_accum_steps,
            config.compression, recompute=config.recompute != "none",
            zero=config.zero_stage, offload=config.offload != "none")
        need = cost.memory_bytes(prof, candidate, config.global_batch_size,
                                 config.optimizer, config.schedule)
        how = "planner's estimate"
    share = need / memory_bytes
    detail = (f"{how}: {need / 1e6:.1f} MB of {memory_bytes / 1e6:.1f} MB per device "
              f"({share:.1%}; device memory: {where})")
    if share > MEMORY_WARN:
        return Check("memory headroom", "WARN" if share <= 1 else "FAIL", detail,
                     "likely out of memory: --recompute=blocks, --zero_stage, more "
                     "micro-batches (--grad_accum_steps), tensor or pipeline parallelism, "
                     "or a smaller batch (see python -m tfpar.plan)")
    return Check("memory headroom", "PASS", detail)


def check_collectives(runtime):
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        hint = ("" if os.environ.get("NCCL_DEBUG") else
                "set NCCL_DEBUG=INFO to see NCCL's transport choice if steps are slow or hang")
        topo = ""
        if shutil.which("nvidia-smi"):
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                 timeout=20)
            topo = " | " + " ".join(out.stdout.split()[:40])
        return Check("collectives", "PASS", f"{runtime.collective} on {len(gpus)} GPU(s){topo}",
                     hint)
    return Check("collectives", "PASS", f"{runtime.collective} over CPU devices")


def diagnose(config, environ=os.environ, peer_timeout=10.0):
    """Runs every check for `config` on the backend the trainer would run it on; returns
    the list of `Check`s."""
    checks = []
    tf_check, cluster = check_tf_config(environ, peer_timeout)
    checks.append(tf_check)
    checks.append(check_learning_rate(config))
    if tf_check.status == "FAIL":
        return checks
    try:  # the trainer's own rulebook on this config and cluster, before TensorFlow
        compat.check_inputs(config, cluster)
    except ConfigError as err:
        return checks + [Check("settings", "FAIL", str(err))]
    from tfpar import backends, data, memory

    backend = backends.for_config(config)  # the backend the trainer would run
    try:
        runtime = backend.build_runtime(config, environ)
    except TfparError as err:
        return checks + [Check("strategy", "FAIL", str(err))]
    on_mesh = hasattr(runtime, "mesh")
    checks.append(Check("devices", "PASS", _topology(runtime, on_mesh)))
    checks.append(check_batch(config, runtime.replicas))
    if not on_mesh:
        checks.append(check_collectives(runtime))
    safe = config.replace(global_batch_size=_splittable(config, runtime.replicas))
    task = data.make_task(safe)
    model = backend.build_model(safe, runtime, task)
    peaks = _one_step_peaks(backend, safe, runtime, model, task, on_mesh)
    measured = None
    if peaks is not None and safe.global_batch_size == config.global_batch_size:
        # Logical CPUs share one allocator: its peak is every device's; per device, /n.
        measured = max(peaks) // (len(peaks) if memory.shares_allocator() else 1)
    available, where = memory.device_memory()
    checks.append(check_memory(config, runtime.replicas, available, where, measured))
    if on_mesh:  # DTensor keeps one logical copy of each weight: nothing to drift apart
        return checks + [Check("replicas in sync", "PASS", "a DTensor mesh holds each weight "
                               "once (sharded or replicated by DTensor)")]
    checks.append(check_replicas_in_sync(runtime, model))
    checks.append(check_communication(runtime, model, task, safe)[0])
    return checks


def _topology(runtime, on_mesh):
    from tfpar import devices

    if not on_mesh:
        return devices.topology(runtime.strategy, runtime.workers)
    from tfpar.layout.mesh import describe

    return " | ".join([devices.topology(None, runtime.workers)] +
                      [describe(mesh) for mesh in runtime.meshes])


def _one_step_peaks(backend, config, runtime, model, task, on_mesh):
    """The allocator's peak per device over one training step (None where unreadable), run
    as the trainer runs it."""
    from tfpar import data, memory, metrics

    if not on_mesh:
        memory.reset_peaks()
        model.fit(data.distributed_dataset(runtime.strategy, config, task), epochs=1,
                  steps_per_epoch=1, verbose=0)
        return memory.peak_bytes()
    one = config.replace(steps=1, steps_per_epoch=1, checkpoint_dir="", tensorboard_dir="",
                         validation_steps=0, verbose=0)
    backend.fit(one, runtime, model, task, metrics.StepRecorder(), [])
    return memory.peak_bytes()


def _splits_any_batch(config):
    """The generated data splits any batch over any replicas, pipelined or not
    (`tfpar.replica_split`); a --dataset function needs one the replicas divide."""
    return config.dataset == "auto"


def _splittable(config, replicas):
    """A batch close to the configured one that splits, so later checks can still run."""
    if config.global_batch_size % replicas == 0 or _splits_any_batch(config):
        return config.global_batch_size
    return max(replicas, config.global_batch_size // replicas * replicas)


def main(argv):
    del argv
    try:
        config = tfpar_flags.config_from_flags()
        checks = diagnose(config, peer_timeout=FLAGS.peer_timeout_s)
    except TfparError as err:
        print(f"tfpar.doctor: error: {err}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks]))
    else:
        for check in checks:
            print(check.line())
    sys.exit(1 if any(c.status == "FAIL" for c in checks) else 0)


def run():
    """`tfpar-doctor` / `python -m tfpar.doctor`."""
    # The allocator's peak per device is readable on CPU only with the BFC allocator,
    # chosen before TensorFlow starts (as tfpar.train does); a user's setting wins.
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
