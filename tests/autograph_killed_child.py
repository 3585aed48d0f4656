"""Child of tests/test_launch.py, started by `python -m tfpar.launch --workers=1`: traces a
function autograph converts (its source goes to the temporary directory, removed at exit),
prints what autograph wrote there, then kills itself with SIGKILL, so no exit handler runs.
A real file: autograph cannot convert code given with `python -c` (no source to read)."""

import json
import os
import signal
import tempfile

import tensorflow as tf


@tf.function
def f(x):
    if x > 0:  # Python control flow on a tensor: autograph converts the function
        x = x * 2
    return x


f(tf.constant(1.0))
written = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("__autograph")]
print(json.dumps({"written": written}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
