"""`python -m tfpar.train`: the one trainer. config → backend → runtime → model → fit → metrics.

With no flags it trains a small MLP on a generated teacher task over every local device
and prints a summary. `--flagfile=configs/NAME.cfg` runs a recipe; under `TF_CONFIG` (or
`python -m tfpar.launch`) the same command is one worker of a multi-worker job.

Every run goes through `train(config)`, which drives the backend `tfpar.compat` picks for
the config (`tfpar.backends`: tf.distribute with or without a pipeline, a DTensor mesh for
`tensor_parallel > 1`, tf_keras for `keras=2`) through the same four calls. Importing this
module defines no flag: `run()` (the `tfpar-train` console script, and `python -m`) does.
It imports no TensorFlow either: `run()` checks the flags, the config and `TF_CONFIG`
first (`check_inputs`), so a bad command line ends in its one line before TensorFlow loads.
"""

import itertools
import os
import sys

# The CPU allocator must be BFC for per-device memory figures (tfpar.memory), chosen before
# TensorFlow starts: `python -m tfpar.train` and callers importing this module before
# tensorflow get it; a user's own setting wins. (It changes no result, only the allocator.)
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from absl import app  # noqa: E402

from tfpar import compat, cpu_kernels, relayout, tf_config  # noqa: E402
from tfpar import flags as tfpar_flags  # noqa: E402
from tfpar.errors import PeerError, TfparError  # noqa: E402

# TensorFlow (~5 CPU seconds to import) loads only once the command line, the config and
# TF_CONFIG have passed `check_inputs`: a bad command line ends in its one line at once.
# The names below, re-exported for callers, load it on first access (PEP 562).
_LAZY = {"fit_segments": "tfpar.checkpoint",  # resume arithmetic
         "LinearWarmup": "tfpar.optimizers", "learning_rate": "tfpar.optimizers",
         "make_optimizer": "tfpar.optimizers"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)


def check_inputs(config, environ=None):
    """What `train(config)` would refuse first that needs no TensorFlow: `TF_CONFIG` (from
    `environ`, default `os.environ`), the rows of `compat`'s table that depend on the
    cluster (`compat.check_cluster`: a pipeline across workers, DTensor's clients), the
    `--strategy` it contradicts and a mesh's degrees that do not match `--cpu_devices`
    (`compat.check_devices`), in the order the backends check them, with the same errors.
    (`config` itself was checked when built.)

    Raises:
        ConfigError: naming the setting, its value and what would work.
    """
    compat.check_inputs(config, tf_config.load(os.environ if environ is None else environ))


def train(config, environ=None, callbacks=(), runtime=None):
    """Trains `config` on the backend it needs; returns `(metrics, model)`.

    `metrics` is the dict of `tfpar.metrics.summarize` (the metrics JSON described in
    `tfpar.metrics`, also written to `config.metrics_json` by the chief); `model` is the
    trained model (a `PipelineModel` for pipelines, a `tf_keras` model for `keras=2`, the
    Keras model whose variables live on the mesh for `tensor_parallel > 1`).

    Args:
        config: the `ParallelConfig` to run.
        environ: where to read `TF_CONFIG` from (default `os.environ`).
        callbacks: extra callbacks for every `fit` call: Keras 3 callbacks, or `tf_keras`
            callbacks with `keras=2`.
        runtime: the runtime of an earlier `train` call (or of `tfpar.strategy.make_runtime`)
            to train on instead of building a new one: how one process trains several
            models on its one strategy. It must suit the config's backend (a tf.distribute
            runtime for data parallelism, pipelines and tf_keras).

    Call in a fresh process (or pass the `runtime` of the earlier call): `config.cpu_devices`
    must be applied before TensorFlow initialises, and TensorFlow allows one distribution
    strategy per process.

    Raises:
        ConfigError: a setting, `TF_CONFIG`, the `--dataset` function or the checkpoint
            directory is unusable.
        TfparError: the run cannot proceed (peers missing, loss not finite, ...);
            `tfpar.oom.OutOfMemoryError` when a device ran out of memory.
    """
    # An elastic launch's new world: mesh degrees for its devices (else `config` itself).
    config = relayout.for_cluster(config, environ)
    # Set before TensorFlow starts if it has not; then checked against what it runs.
    kernels = cpu_kernels.apply(config.cpu_kernels)
    import tensorflow as tf

    from tfpar import backends, data, memory, metrics
    from tfpar import strategy as strategy_lib
    from tfpar.pipeline import remote

    backend = backends.for_config(config)
    runtime = backend.build_runtime(config, environ, runtime)
    task = data.make_task(config)
    try:
        model = backend.build_model(config, runtime, task)
        recorder = metrics.StepRecorder()
        added = backend.fit(config, runtime, model, task, recorder, list(callbacks))
        result = backend.stats(config, runtime, model, task, recorder)
    except tf.errors.OpError as err:
        # One line: the device, the bytes, settings that would fit (tfpar.oom); on a mesh
        # the OOM may surface as a cancelled collective (memory.is_out_of_memory).
        if not memory.is_out_of_memory(err):
            raise
        raise memory.out_of_memory_error(err, config, runtime.replicas) from err
    result.update(added)
    result["cpu_kernels"] = kernels
    if config.metrics_json and runtime.is_chief:
        metrics.write_json(config.metrics_json, result)
    if runtime.workers > 1 and getattr(runtime, "kind", None) != remote.KIND \
            and not result.get("preempted"):
        # Worker 0 hosts the coordination service: leaving before the others finish their
        # last collective aborted it there (test_layout_pipeline_workers, one CI run).
        # The cross-worker pipeline's other workers never get here (they serve the chief).
        strategy_lib.wait_for_workers("tfpar.train", config.collective_timeout_s)
    return result, model


def _cause(err):
    """The informative line of a TensorFlow runtime error (its first line is often just
    'Graph execution error:')."""
    lines = [line.strip() for line in (err.message or str(err)).splitlines() if line.strip()]
    for key in ("unhealthy", "timed out", "Deadline", "Error reported from", "aborted"):
        for i, line in enumerate(lines):
            if key in line:
                # The tasks a heartbeat error names follow it, one a line: all of them
                # (the launcher loses a host when every worker of it is named).
                follow = list(itertools.takewhile(lambda t: t.startswith("/job:"),
                                                  lines[i + 1:]))
                detail = (" ".join(follow) or " ".join(lines[i + 1:i + 2])[:300]
                          if line.endswith(":") else "")
                # only the key line is cut: the names after it are whole
                return f"{line[:300]} {detail}".strip()
    return lines[0][:300] if lines else type(err).__name__


def _exit_on(err):
    """Ends the process with `err`'s one line: exit status 2 (`tfpar.launch` does not
    retry it), or 1 for a `PeerError` (a restart may mend it)."""
    print(f"tfpar: error: {err}", file=sys.stderr, flush=True)
    sys.exit(1 if isinstance(err, PeerError) else 2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        config = relayout.for_cluster(tfpar_flags.config_from_flags())
        check_inputs(config)
        cpu_kernels.select(config.cpu_kernels)  # TensorFlow reads it once, when it starts
    except TfparError as err:
        _exit_on(err)
    import tensorflow as tf

    from tfpar import metrics
    from tfpar.oom import OutOfMemoryError

    tf.get_logger().setLevel("WARNING")
    try:
        result, _ = train(config)
    except TfparError as err:
        if isinstance(err, OutOfMemoryError):
            print(f"tfpar: error: {err}", file=sys.stderr, flush=True)
            # On a mesh the devices that did not run out wait in cancelled collectives,
            # and TensorFlow's shutdown waits for them: the process would hang after the
            # line. Nothing is left to save (checkpoints are written before a step runs).
            sys.stdout.flush()
            os._exit(2)
        _exit_on(err)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.CancelledError, tf.errors.AbortedError) as err:
        # A dead, stalled or missing peer: say so in one line instead of a C++ stack.
        print(f"tfpar: error: a collective with the other workers failed "
              f"({type(err).__name__}: {_cause(err)}); a peer died, stalled past "
              f"--collective_timeout_s or --heartbeat_timeout_s, or never started",
              file=sys.stderr, flush=True)
        sys.exit(1)
    print(metrics.summary_line(result), flush=True)
    if result.get("preempted"):
        print(f"tfpar: preempted (SIGTERM): checkpoint saved at step "
              f"{result['resumed_from_step'] + result['steps']}; run the same command to resume",
              file=sys.stderr, flush=True)
        sys.exit(143)


def run():
    """`tfpar-train` / `python -m tfpar.train`: defines the flags, parses them, trains."""
    tfpar_flags.define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
