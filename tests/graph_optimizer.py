"""The graph optimizer a test child runs with: TensorFlow's default (grappler on, what users
run) unless the test passes `OFF` in the child's environment (`TFPAR_TEST_GRAPPLER=off`)
and the child calls `apply()` before its first `tf.function` runs.

A mesh run's cost in the suite is its first call, not its steps: grappler optimizing each
device's piece of the traced step was a quarter to a third of a mesh child's CPU after
the TensorFlow import (docs/benchmarks/suite.md, 2026-12-06). Files whose every comparison
runs both sides in children with the same setting (a codec against its uncompressed run,
one backend against the other) may turn it off; no assertion of theirs reads a graph after
grappler (the profiler's op counts of tests/test_mesh_adam_front.py run with it on). Each
family keeps files that run with grappler on: data parallelism (tests/test_train.py), the
mesh (tests/test_layout_mesh.py, tests/test_layout_keras.py), pipelines and 3D
(tests/test_layout_pipeline.py, tests/test_keras_3d.py), ZeRO-3
(tests/test_zero3_prefetch.py), the CLI (tests/test_train.py). Which files turn it off:
WORKSPACE.md and docs/benchmarks/suite.md.
"""

import os

VARIABLE = "TFPAR_TEST_GRAPPLER"
OFF = {VARIABLE: "off"}


def apply():
    """In a child: grappler's meta optimizer off when the environment says `OFF`. Call it
    before the child's first `tf.function` call (the setting is read at each function's
    first call); it starts no runtime. Returns whether it was turned off."""
    value = os.environ.get(VARIABLE, "")
    if value not in ("", "off"):
        raise ValueError(f"{VARIABLE}={value!r}: 'off' or unset")
    if value == "off":
        import tensorflow as tf
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    return value == "off"
