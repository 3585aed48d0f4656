"""The graph optimizer a test child runs with: TensorFlow's default (grappler on, what users
run) unless the test passes `OFF` in the child's environment (`TFPAR_TEST_GRAPPLER=off`)
and the child calls `apply()` before its first `tf.function` runs.

A mesh run's cost in the suite is its first call, not its steps: with grappler off the
eight files that turn it off took about a quarter less CPU (docs/benchmarks/suite.md,
2026-12-06, per file). Files whose every comparison runs both sides in children with the
same setting (a codec against its uncompressed run, one backend against the other) may
turn it off; no assertion of theirs reads a graph after
grappler (the profiler's op counts of tests/test_mesh_adam_front.py run with it on). Each
family keeps files that run with grappler on: data parallelism (tests/test_train.py), the
mesh (tests/test_layout_mesh.py, tests/test_layout_keras.py), pipelines and 3D
(tests/test_layout_pipeline.py, tests/test_keras_3d.py but its codec files' child), ZeRO-3
(tests/test_zero3_prefetch.py), the CLI (tests/test_train.py). A file that turns it off
for a feature no other file trains keeps one short case of that feature in a child of its
own with the default (grappler fuses kernels and its dependency optimizer edits the
control edges tfpar adds around collectives): which files and features, WORKSPACE.md and
docs/benchmarks/suite.md.

Every child that calls `apply()` reports `setting()` in its JSON result ("off" or
"default"); the tests that pass `OFF` assert "off", and those files' cases with the
default assert "default". `subproc.child_env` passes
`TFPAR_TEST_GRAPPLER` to a child only when the test sets it (a value in the shell that
runs pytest does not reach the children).

The setting is cached per thread: TensorFlow builds a thread's function-call options
(`context.function_call_options`, with the optimizer's settings) at that thread's first
`tf.function` call, and `tf.config.optimizer.set_experimental_options` resets only the
calling thread's. `apply()` therefore runs first in the child's main thread, before the
child starts any thread; a thread started after it builds its options from the new
setting.
"""

import os

VARIABLE = "TFPAR_TEST_GRAPPLER"
OFF = {VARIABLE: "off"}


def apply():
    """In a child: grappler's meta optimizer off when the environment says `OFF`. Call it
    first in the main thread, before any `tf.function` call or thread (the module's
    docstring); it starts no runtime. Returns "off" or "default" (`setting()` reads what
    the calls ran with; this reads the environment, so that this thread's options are not
    built here, before the child's own settings)."""
    value = os.environ.get(VARIABLE, "")
    if value not in ("", "off"):
        raise ValueError(f"{VARIABLE}={value!r}: 'off' or unset")
    if value == "off":
        import tensorflow as tf
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    return "off" if value == "off" else "default"


def setting():
    """"off" or "default": what this thread's `tf.function` calls run with (read from its
    function-call options, the ones TensorFlow passes to each call), for a child's JSON."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context
    options = config_pb2.ConfigProto.FromString(
        context.context().function_call_options.config_proto_serialized)
    return "off" if options.graph_options.rewrite_options.disable_meta_optimizer else "default"
