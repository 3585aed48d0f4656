"""A mesh job or a pipeline across workers that an elastic launch restarts on another
number of workers gets degrees for the devices it has now. Imports no TensorFlow.

`tfpar.launch` sets `TFPAR_ELASTIC=1` for the workers of an elastic job (`--min_workers`
below `--workers`, `--max_workers` above it, or `--discovery`). When such a worker runs a
DTensor mesh (tensor parallel, 3D, ZeRO-3) whose `--data_parallel` × `--tensor_parallel` ×
`--pipeline_stages` do not fill the devices of the current cluster (`--cpu_devices` per
worker × workers), the degrees are chosen again by one rule (`ParallelDims.for_world`):
keep `tensor_parallel` × `pipeline_stages` if they fit and let `data_parallel` take what
they leave; else the largest model-parallel degrees that fit (a divisor of
`tensor_parallel`, at most `pipeline_stages`); the first such layout the rulebook accepts
(`tfpar.compat`) runs, and one line says what changed. The checkpoint loads onto the new
layout (`tfpar.state`), and the global batch is kept (`tfpar.replica_split`).

On real devices (`--cpu_devices` 0 or 1) their count is known only once TensorFlow lists
them: `data_parallel` then becomes 0 (what `tensor_parallel` × `pipeline_stages` leave) and
those two stay.

A tf.distribute pipeline across workers holds one stage per worker (`tfpar.pipeline.remote`,
the rulebook's `ACROSS_WORKERS`): on another number of workers `pipeline_stages` becomes
the workers (the model split again; the checkpoint names weights and slots by Keras path,
so it loads onto the new stages); on one worker left, the most stages its logical CPUs
hold beside the replicas, else data parallel. Its replicas (`--data_parallel`, else
`--cpu_devices`) and the global batch stay.

>>> from tfpar import ParallelConfig
>>> config = ParallelConfig(model="mlp", tensor_parallel=2, data_parallel=2, cpu_devices=2)
>>> env = {"TFPAR_ELASTIC": "1", "TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, '
...        '"task": {"type": "worker", "index": 0}}'}
>>> new = for_cluster(config, env, say=lambda line: None)
>>> new.data_parallel, new.tensor_parallel
(1, 2)
"""

import os
import sys

from tfpar import compat, tf_config
from tfpar.dims import ParallelDims
from tfpar.errors import ConfigError

ELASTIC_ENV = "TFPAR_ELASTIC"


def _print(line):
    print(line, file=sys.stderr, flush=True)


def for_cluster(config, environ=None, say=_print):
    """`config` with degrees for the cluster of `environ` (default `os.environ`) when an
    elastic launch started it and its mesh's degrees do not fill the cluster's devices or
    its pipeline's stages are not one per worker (see the module docstring); else
    `config` itself. `say` gets the one line.

    Raises:
        ConfigError: a pipeline's settings refuse the stage count the new world needs
            (e.g. the interleaved schedule's micro-batches), naming the setting and why.
    """
    environ = os.environ if environ is None else environ
    if environ.get(ELASTIC_ENV) != "1":
        return config
    backend = compat.backend_of(config)
    if backend not in ("dtensor", "pipeline"):
        return config
    cluster = tf_config.load(environ)
    workers = cluster.num_workers if cluster is not None else 1
    if backend == "pipeline":
        return _pipeline_for(config, cluster, workers, say)
    dims = ParallelDims.from_config(config, workers=workers)
    if config.cpu_devices <= 1:  # devices not known before TensorFlow: dp from them
        if not config.data_parallel:
            return config
        return _say(config, config.replace(data_parallel=0), "real devices", say)
    devices = config.cpu_devices * workers
    if dims.fits(devices):
        return config
    for new in dims.for_world(devices, workers):
        try:
            relaid = config.replace(data_parallel=new.dp, tensor_parallel=new.tp,
                                    pipeline_stages=new.pp)
            compat.check_inputs(relaid, cluster)
        except ConfigError:
            continue
        return _say(config, relaid, f"{devices} devices of {workers} worker(s)", say)
    return config  # nothing fits: the trainer's own line names the degree


def _pipeline_for(config, cluster, workers, say):
    """A tf.distribute pipeline (`--pipeline_stages` > 1) in an elastic job: across
    several workers one stage per worker (`tfpar.compat.ACROSS_WORKERS`), so
    `pipeline_stages` = workers; on one worker left, the most stages up to the old count
    that its logical CPUs hold beside the replicas (`--cpu_devices` >= stages × replicas),
    else data parallel (`pipeline_stages=1`) on those replicas. The replicas
    (`--data_parallel`, else `--cpu_devices`) and the global batch stay."""
    if workers > 1:
        if config.pipeline_stages == workers:
            return config
        candidates = [workers]
        why = "a pipeline across workers holds one stage per worker"
    else:
        replicas = compat.pipeline_replicas(config)
        most = min(config.pipeline_stages, max(1, config.cpu_devices) // replicas)
        if most == config.pipeline_stages:
            return config  # the one process holds every stage: the run as asked
        candidates = [*range(most, 1, -1), 1]
        why = (f"one worker left: its {max(1, config.cpu_devices)} logical CPU(s) hold "
               f"{replicas} replica(s) of at most {max(most, 1)} stage(s)")
    first = refused = None
    for stages in candidates:
        try:
            relaid = config.replace(pipeline_stages=stages)
            first = first or relaid
            compat.check_inputs(relaid, cluster)
        except ConfigError as err:
            refused = refused or err
            continue
        break
    else:  # none accepted: the first runs, so that the trainer's refusal names its setting
        if first is None:  # not even a valid config: say what blocks the new stage count
            raise ConfigError(refused.setting, refused.value,
                              f"{refused.expected} (an elastic job on {workers} worker(s) "
                              f"needs pipeline_stages={candidates[0]}: {why})")
        relaid = first
    stages = relaid.pipeline_stages
    how = (f"the model split into {stages} stages, the checkpoint loads onto them"
           if stages > 1 else "data parallel, the whole model on each replica; the "
           "checkpoint loads onto it")
    return _say(config, relaid, f"{workers} worker(s)", say, f"{why}; {how}")


def _say(old, new, where, say, why=None):
    degrees = lambda c: (f"{c.data_parallel or 'auto'}×{c.tensor_parallel}"  # noqa: E731
                         f"×{c.pipeline_stages}")
    why = why or ("tensor × pipeline degrees kept where they fit; the checkpoint reshards "
                  "onto the new layout")
    say(f"tfpar: elastic: data_parallel × tensor_parallel × pipeline_stages "
        f"{degrees(old)} -> {degrees(new)} for the {where} ({why})")
    return new
