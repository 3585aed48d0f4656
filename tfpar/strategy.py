"""Builds the `tf.distribute` strategy a `ParallelConfig` asks for.

`auto` picks `MultiWorkerMirroredStrategy` when `TF_CONFIG` names a cluster of several
workers, `MirroredStrategy` over all local devices when there are several, and
`OneDeviceStrategy` otherwise. Collectives: NCCL on GPUs, ring on CPUs. Multi-worker jobs
get a coordination-service heartbeat, a registration deadline and a collective timeout so
that a dead, stalled or missing peer becomes an error instead of a hang.
"""

import contextlib
import dataclasses
import os
import subprocess
import sys

import tensorflow as tf
from absl import logging
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2

from tfpar import devices, patches, preemption
from tfpar import tf_config as tf_config_lib
from tfpar.errors import ConfigError, PeerError

READY_LINE = "TFPAR_READY"  # printed once the strategy is built; tfpar.launch waits for it


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What the strategy factory built: the strategy and facts every other part reads."""

    strategy: tf.distribute.Strategy
    kind: str  # one_device | mirrored | multi_worker | pipeline_workers (pipeline.remote)
    workers: int
    worker_index: int
    is_chief: bool
    collective: str  # ring | nccl | none

    @property
    def replicas(self):
        return self.strategy.num_replicas_in_sync


def choose_kind(config, cluster):
    """The strategy kind for `config.strategy` given the parsed `TF_CONFIG` (or None)."""
    if config.strategy == "auto":
        if cluster is not None and cluster.num_workers > 1:
            return "multi_worker"
        local = devices.local_device_count(config.cpu_devices)
        return "mirrored" if local > 1 else "one_device"
    tf_config_lib.check_strategy(config.strategy, cluster)
    return config.strategy


def choose_collective(config):
    gpus = tf.config.list_physical_devices("GPU")
    if config.collective == "nccl" and not gpus:
        raise ConfigError("collective", "nccl",
                          "NCCL needs GPUs and none were found; use --collective=ring or auto")
    if config.collective == "auto":
        return "nccl" if gpus else "ring"
    return config.collective


def make_runtime(config, environ=None):
    """Builds the strategy for `config` and returns a `Runtime`.

    Call after `devices.split_cpu(config.cpu_devices)` and before any model is built.

    Raises:
        ConfigError: a setting or `TF_CONFIG` is invalid.

    A multi-worker job whose peers do not all register within `startup_timeout_s` is ended
    by a watchdog process with one `tfpar: error:` line (the constructor cannot be
    interrupted from Python).
    """
    cluster = tf_config_lib.load(os.environ if environ is None else environ)
    kind = choose_kind(config, cluster)
    collective = choose_collective(config)
    patches.apply()
    if kind == "one_device":
        strategy = tf.distribute.OneDeviceStrategy(devices.compute_devices()[0])
        collective = "none"
    elif kind == "mirrored":
        # Each replica of a pipeline needs a device per stage.
        replicas = config.dims.replicas(len(devices.compute_devices()))
        cross_ops = tf.distribute.NcclAllReduce() if collective == "nccl" else None
        strategy = tf.distribute.MirroredStrategy(
            devices.compute_devices()[:replicas], cross_device_ops=cross_ops)
    else:
        strategy = _multi_worker(config, cluster, collective)
    runtime = Runtime(
        strategy=strategy, kind=kind,
        workers=cluster.num_workers if kind == "multi_worker" else 1,
        worker_index=cluster.worker_index if kind == "multi_worker" else 0,
        is_chief=cluster.is_chief if kind == "multi_worker" else True,
        collective=collective)
    if config.data_parallel and kind != "mirrored" and config.data_parallel != runtime.replicas:
        raise ConfigError("data_parallel", config.data_parallel,
                          f"the {kind} strategy has {runtime.replicas} replicas")
    print(READY_LINE, file=sys.stderr, flush=True)
    return runtime


def _multi_worker(config, cluster, collective):
    if not tf.config.list_physical_devices("GPU"):
        patches.cpu_devices_per_worker(devices.local_device_count(config.cpu_devices))
    _configure_coordination(config, cluster)
    implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL
                      if collective == "nccl" else
                      tf.distribute.experimental.CommunicationImplementation.RING)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation, timeout_seconds=config.collective_timeout_s)
    # A peer that never starts blocks the constructor in C++ while holding the GIL (stock
    # TF: > 10 minutes, deaf to SIGTERM), so no Python thread or signal handler can act; a
    # watchdog process ends this one if the strategy is not built in time.
    message = (f"tfpar: error: workers did not all start within startup_timeout_s="
               f"{config.startup_timeout_s:g}: is every worker of {cluster.addresses} started?")
    with _watchdog(config.startup_timeout_s, message):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver(),
            communication_options=options)
    # The constructor installed TensorFlow's own SIGTERM handler: from here on a SIGTERM
    # saves and stops (with checkpoints) or ends the worker.
    preemption.hold_sigterm(bool(config.checkpoint_dir))
    return strategy


_WATCHDOG = """
import os, select, signal, sys
ready, parent, timeout, message = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
if not select.select([ready], [], [], timeout)[0]:
    sys.stderr.write(message + chr(10)); sys.stderr.flush()
    os.kill(parent, signal.SIGKILL)
"""


@contextlib.contextmanager
def _watchdog(timeout, message):
    """Kills this process with `message` unless the block finishes within `timeout` s."""
    read_end, write_end = os.pipe()
    # In a session of its own: a launcher stopping this worker's process group must not
    # kill the watchdog first (the worker then failed writing to it); it exits on its own
    # once this process is gone (its pipe reads end-of-file).
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(read_end), str(os.getpid()), str(timeout),
         message], pass_fds=(read_end,), start_new_session=True)
    os.close(read_end)
    try:
        yield
    finally:
        with contextlib.suppress(BrokenPipeError):  # the watchdog was killed from outside
            os.write(write_end, b"x")
        os.close(write_end)
        watchdog.wait()


def _configure_coordination(config, cluster):
    """Heartbeat and registration deadline for the coordination service (before TF's own
    defaults are set by the strategy constructor, which then leaves them alone)."""
    leader_job = "chief" if "chief" in cluster.cluster else "worker"
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(cluster.cluster[job]))
            for job in ("chief", "worker") if job in cluster.cluster]
    try:
        patches.configure_coordination_service(
            service_type="standalone",
            service_leader=f"/job:{leader_job}/replica:0/task:0",
            heartbeat_timeout_in_ms=int(config.heartbeat_timeout_s * 1000),
            cluster_register_timeout_in_ms=int(config.startup_timeout_s * 1000),
            shutdown_barrier_timeout_in_ms=int(config.heartbeat_timeout_s * 1000),
            coordinated_jobs=jobs)
    except Exception as err:  # a TF change here must not stop training, only weaken bounds
        logging.warning("coordination service not configured (%s); peers' failures may "
                        "take longer to surface", err)


_BARRIER_CALLS = {}  # name -> calls so far: each call is a barrier of its own


def wait_for_workers(name="exit", timeout_s=300.0):
    """Blocks until every worker of this multi-worker job has called
    `wait_for_workers(name)` as many times as this one has.

    Worker 0 hosts TensorFlow's coordination service: when it exits while another worker
    still runs its last collective, that worker's collective aborts. Call this at the end
    of your own multi-worker script (every worker, after its last collective) so that no
    worker leaves before the others are done; `tfpar.train.train` ends with it. It returns
    only once every worker has had the barrier's answer (a second round), so worker 0 may
    exit right after it. In a single process (no coordination service) it returns at once.

    Args:
        name: the barrier's name; every worker must use the same names in the same order.
        timeout_s: how long to wait for the others, in seconds.

    Returns:
        True if it waited for other workers, False in a single process.

    Raises:
        ConfigError: a bad `name` or `timeout_s`.
        PeerError: the others did not all arrive within `timeout_s` (one line).
        tf.errors.OpError: the coordination service reported a failed peer.

    Examples:
        >>> import tfpar
        >>> tfpar.wait_for_workers()  # one process: nothing to wait for
        False
    """
    if not isinstance(name, str) or not name:
        raise ConfigError("name", name, "a non-empty string, the same on every worker")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not timeout_s > 0:
        raise ConfigError("timeout_s", timeout_s, "seconds > 0, e.g. 300")
    calls = _BARRIER_CALLS.get(name, 0)
    _BARRIER_CALLS[name] = calls + 1
    try:
        waited = patches.wait_at_barrier(f"tfpar/{name}:{calls}", timeout_s)
    except tf.errors.DeadlineExceededError as err:
        # Other errors (a peer that died: Unavailable, Aborted) pass through as the
        # collective failures they are (`tfpar.train` prints its collective-failure line).
        raise PeerError(
            f"workers did not all reach barrier {name!r} (call {calls + 1}) within "
            f"timeout_s={timeout_s:g} ({type(err).__name__}: "
            f"{_first_line(err)}): a worker failed, died or lags; if one is "
            f"only slow, raise the timeout (tfpar.train: --collective_timeout_s)") from err
    if waited:
        _wait_until_all_returned(f"tfpar/{name}:{calls}/returned", min(timeout_s, 60.0))
    return waited


def _wait_until_all_returned(barrier_id, timeout_s):
    """A second barrier, called once the first has returned here, so that worker 0 (which
    hosts the coordination service) leaves only after every worker has had the first
    barrier's answer: when worker 0 exited at once after it, another worker's answer was
    still on the wire and its barrier failed with "Socket closed" (test_barrier, one CI
    run in ~15). Every worker passed the first barrier, so this one's own errors (the
    same lost answer, now harmless, or a worker that died after the end) are logged."""
    try:
        patches.wait_at_barrier(barrier_id, timeout_s)
    except tf.errors.OpError as err:
        logging.info("every worker reached the barrier; its second round (%s) ended "
                     "with %s: %s", barrier_id, type(err).__name__, _first_line(err))


def _first_line(err):
    """The first line of a TensorFlow error's message, at most 200 characters."""
    lines = (err.message or str(err)).strip().splitlines()
    return lines[0][:200] if lines else ""

