"""Pipeline stages on other processes (or machines): one stage per worker process.

Two ways in. From the trainer, `python -m tfpar.launch --workers=K -- python -m
tfpar.train --pipeline_stages=K ...` (`make_runtime` below): worker 0 is the client and
holds stage 0, worker s serves stage s and exits when worker 0 has gone; with
`--cpu_devices=R` each worker holds its stage of R replicas, one a logical CPU. From Python:

Each worker process only serves its devices (`python -m tfpar.pipeline.remote
--workers=HOST:PORT,HOST:PORT --task=I`); one client process connects to all of them,
builds the `PipelineModel` with stage devices `/job:worker/replica:0/task:I/device:CPU:0`
and runs `fit`. The whole step is one `tf.function`, so TensorFlow sends each stage its
part of the graph once and only activations and gradients cross between processes (remote
eager execution would be one RPC per op: ~16x slower, measured).

Example (client):
>>> devices = connect(["localhost:2222", "localhost:2223"])
>>> pm = PipelineModel.split(model, 2, "1f1b", microbatches=4, devices=devices)
"""

import argparse
import os
import signal
import socket
import sys
import threading
import time

import tensorflow as tf
from absl import logging

from tfpar import compat
from tfpar.dims import ParallelDims
from tfpar.errors import ConfigError, PeerError

JOB = "worker"


def _cluster(workers):
    workers = [w.strip() for w in workers if w.strip()]
    for w in workers:
        host, _, port = w.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("workers", w, "give HOST:PORT for every worker")
    if not workers:
        raise ConfigError("workers", workers, "give at least one HOST:PORT")
    return tf.train.ClusterSpec({JOB: workers})


def stage_devices(num_workers, device="CPU:0"):
    """The device of stage i on worker task i, for `num_workers` workers."""
    return [f"/job:{JOB}/replica:0/task:{i}/device:{device}" for i in range(num_workers)]


def connect(workers, device="CPU:0"):
    """Connects this (client) process to the worker processes at `workers` and returns one
    stage device per worker. Call before any other TensorFlow work in this process.

    Args:
        workers: list of "HOST:PORT", worker task i first.
        device: the device on each worker that runs its stage.
    Raises:
        ConfigError: a malformed address.
    """
    cluster = _cluster(workers)
    # A ClusterSpec, not a resolver: a resolver without a master counts as local and
    # connects nothing.
    tf.config.experimental_connect_to_cluster(cluster, job_name="localhost")
    return stage_devices(len(workers), device)


def serve(workers, task):
    """Runs worker `task` of the cluster `workers` until the process is killed."""
    cluster = _cluster(workers)
    if not 0 <= task < len(workers):
        raise ConfigError("task", task, f"must be in [0, {len(workers)})")
    server = tf.distribute.Server(cluster, job_name=JOB, task_index=task, start=True)
    print(f"tfpar: pipeline worker {task} serving at {workers[task]}", flush=True)
    server.join()


KIND = "pipeline_workers"  # the `Runtime.kind` of a pipeline across worker processes
_POLL_S = 0.5


def spans_workers(config, cluster):
    """True when `config` pipelines across the workers of `cluster` (a parsed `TF_CONFIG`,
    or None): `tfpar.compat.spans_workers`."""
    return compat.spans_workers(config, cluster)


def make_runtime(config, cluster, runtime_class):
    """The runtime of a pipeline across the workers of `cluster`: one stage per worker.

    On the chief (worker 0) this connects to the cluster, watches the other workers
    (`watch_stages`) and returns a `runtime_class` (`tfpar.strategy.Runtime`) of kind
    `KIND` whose strategy (`replica_strategy`) runs R pipelines side by side (R:
    `--data_parallel`, else `--cpu_devices`): stage s of replica r on logical CPU r of
    worker s. Every other worker serves its R devices to
    the chief and ends the process (exit 0) once the chief has gone; a chief that failed
    says so in its own exit code.

    Call after `devices.split_cpu(config.cpu_devices)`, before any TensorFlow op.

    Raises:
        ConfigError: a row of `tfpar.compat.ACROSS_WORKERS` (the workers are not one per
            stage, an evaluator task, more replicas than a worker's logical CPUs).
        PeerError: the chief never came up within `startup_timeout_s` (non-chief).
    """
    dims = ParallelDims.from_config(config, workers=cluster.num_workers)
    compat.check_cluster(config, cluster)
    R = compat.pipeline_replicas(config)  # stages run on logical CPUs (GPUs not used)
    jobs = {job: cluster.cluster[job] for job in ("chief", "worker") if job in cluster.cluster}
    spec = tf.train.ClusterSpec(jobs)
    if not cluster.is_chief:
        _serve_until_chief_exits(spec, cluster, R, config.startup_timeout_s)
        print(f"tfpar: pipeline worker {cluster.worker_index}: the chief has finished; "
              f"exiting", file=sys.stderr, flush=True)
        raise SystemExit(0)
    tf.config.experimental_connect_to_cluster(spec, job_name=cluster.task_type,
                                              task_index=cluster.task_index)
    strategy = replica_strategy(_task_name(cluster, 0), R)
    watch_stages(cluster, config.heartbeat_timeout_s, config.startup_timeout_s)
    print("TFPAR_READY", file=sys.stderr, flush=True)  # what tfpar.launch waits for
    return runtime_class(strategy=strategy, kind=KIND, workers=dims.workers, worker_index=0,
                         is_chief=True, collective="none")


LOST_MARKER = "TFPAR_LOST_WORKER"  # the chief names a stage worker that stopped answering


def watch_stages(cluster, timeout_s, startup_timeout_s):
    """On the chief: a daemon thread that runs a trivial op on every other worker every
    `timeout_s` / 4 seconds. A worker that does not answer within 3/4 of `timeout_s` (the
    first time within `startup_timeout_s`), so at most `timeout_s` after it stopped, is
    stopped or cut off: a dead one fails the step at once, but a frozen one (SIGSTOP, a
    hung host, a cut link) would hold the step forever.
    The chief then ends (exit 1) with one `tfpar: error:` line naming the worker, and
    `LOST_MARKER <worker index>`, which `tfpar.launch` reads to count the failure against
    that worker instead of the chief; when two or more workers are probed and none
    answers, the chief's own side is the likelier fault: the line names none, and the
    failure is the chief's."""
    if threading.current_thread() is not threading.main_thread() or cluster.num_workers < 2:
        return
    others = list(range(1, cluster.num_workers))
    answered = {w: threading.Event() for w in others}

    def probe(worker):
        try:
            with tf.device(f"{_task_name(cluster, worker)}/device:CPU:0"):
                tf.identity(tf.constant(0)).numpy()
            answered[worker].set()
        except tf.errors.OpError:  # gone: the step fails on its own, with its own line
            pass

    def watch():
        limit = startup_timeout_s
        while True:
            for event in answered.values():
                event.clear()
            for w in others:
                threading.Thread(target=probe, args=(w,), daemon=True).start()
            started = time.monotonic()
            silent = [w for w in others
                      if not answered[w].wait(max(0.0, limit - (time.monotonic() - started)))]
            if silent and len(silent) == len(others) > 1:
                # Nobody answered: the chief's own side (its link, its host) is the likelier
                # fault; no worker is named, so the launcher counts it against the chief.
                print(f"tfpar: error: none of the {len(others)} pipeline workers answered "
                      f"within heartbeat_timeout_s={timeout_s:g}: this chief's link or host "
                      "is stopped, hung or cut off", file=sys.stderr, flush=True)
                os._exit(1)  # the step waits on them and would never return
            if silent:
                w = silent[0]
                print(f"tfpar: error: pipeline worker {w} ({_address(cluster, w)}) did not "
                      f"answer within heartbeat_timeout_s={timeout_s:g}: it is stopped, hung "
                      f"or cut off\n{LOST_MARKER} {w}", file=sys.stderr, flush=True)
                os._exit(1)  # the step waits on it and would never return
            limit = 0.75 * timeout_s
            time.sleep(0.25 * timeout_s)

    threading.Thread(target=watch, name="tfpar-watch-stages", daemon=True).start()


def _address(cluster, worker_index):
    chiefs = cluster.cluster.get("chief", [])
    workers = cluster.cluster.get("worker", [])
    return (chiefs + workers)[worker_index]


def replica_strategy(task, replicas):
    """The chief's strategy over `replicas` pipelines side by side: their lead devices are
    CPU:0..R-1 of `task` ('/job:J/replica:0/task:T'). With one replica a
    `OneDeviceStrategy`; with more a `MirroredStrategy` whose reductions are plain copies
    and sums (`ReductionToOneDevice`): its default ring collectives wait forever once the
    process is connected to a cluster (their groups are resolved by no leader), while
    copies and sums run as any other op of the step's graph. Every stage's replicas sit on
    one worker (`worker_stage_devices`), so each stage's gradients are summed there, and
    an aggregator's codes (`--compression`) travel between that worker's devices."""
    if replicas == 1:
        return tf.distribute.OneDeviceStrategy(f"{task}/device:CPU:0")
    return tf.distribute.MirroredStrategy(
        [f"{task}/device:CPU:{r}" for r in range(replicas)],
        cross_device_ops=tf.distribute.ReductionToOneDevice())


def worker_stage_devices(cluster, stages, replicas):
    """Per stage s, the `replicas` CPU devices of worker s (the `for_training`
    placements of a pipeline across workers)."""
    return [tuple(f"{_task_name(cluster, s)}/device:CPU:{r}" for r in range(replicas))
            for s in range(stages)]


def _task_name(cluster, worker_index):
    """'/job:J/replica:0/task:T' of training process `worker_index` (chief first)."""
    chiefs = len(cluster.cluster.get("chief", []))
    job, task = ("chief", 0) if worker_index < chiefs else ("worker", worker_index - chiefs)
    return f"/job:{job}/replica:0/task:{task}"


def _serve_until_chief_exits(spec, cluster, cpu_devices, startup_timeout_s):
    """Serves this worker's devices until the chief's address stops accepting
    connections (after it first did).

    A SIGTERM does not end the serving: the chief got one too (`tfpar.launch` stops every
    worker alike, e.g. to grow an elastic job), and its preemption save
    (`tfpar.preemption`) reads this worker's stage; the chief leaves once it is saved, and
    this worker follows (a launcher's SIGKILL after its grace still ends it)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: logging.info(
            "pipeline worker %d: SIGTERM; serving until the chief has left",
            cluster.worker_index))
    server = tf.distribute.Server(
        spec, job_name=cluster.task_type, task_index=cluster.task_index, start=True,
        config=tf.compat.v1.ConfigProto(device_count={"CPU": cpu_devices}))
    print("TFPAR_READY", file=sys.stderr, flush=True)
    logging.info("pipeline worker %d serving at %s", cluster.worker_index, cluster.own_address)
    host, _, port = cluster.cluster["chief" if "chief" in cluster.cluster else "worker"][0] \
        .rpartition(":")
    started, seen = time.monotonic(), False
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
            seen = True
        except OSError:
            if seen:
                break
            if time.monotonic() - started > startup_timeout_s:
                raise PeerError(f"the chief at {host}:{port} did not start within "
                                 f"startup_timeout_s={startup_timeout_s:g}") from None
        time.sleep(_POLL_S)
    del server  # the process ends next; the server goes with it


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tfpar.pipeline.remote",
                                description="Serve this process's devices to a pipeline "
                                            "client (one stage per worker).")
    p.add_argument("--workers", required=True, help="HOST:PORT of every worker, comma-separated")
    p.add_argument("--task", type=int, required=True, help="this worker's index")
    args = p.parse_args(argv)
    serve(args.workers.split(","), args.task)


if __name__ == "__main__":
    main()
