"""Pipeline stages on other processes (or machines): one stage per worker process.

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

import tensorflow as tf

from tfpar.errors import ConfigError

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
