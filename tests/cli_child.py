"""Child process for tests: `python tests/cli_child.py CASES_JSON OUT_DIR`.

Runs the trainer's command line once per case, paying TensorFlow's import once
(tests/forking.py): each case runs `tfpar.train.run()` (what `python -m tfpar.train` runs)
in a process forked from this one, with the case's arguments and environment added, and
exits with the command's exit status. Two cases run at a time.

CASES_JSON is a list of `{"argv": [...], "env": {...}}`; prints one JSON line
`{"cases": [...]}`, per case in order `{"returncode", "stdout", "stderr", "seconds"}`.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What `tfpar.train` loads once a command line passed `check_inputs` (it imports TensorFlow
# only then), loaded here once for every fork, as importing `tfpar.train` used to.
import tensorflow  # noqa: E402,F401
import tfpar.train  # noqa: E402
from tfpar import backends, checkpoint, data, memory, metrics, oom, optimizers  # noqa: E402,F401
from forking import run_forked  # noqa: E402


def command_line(argv, env):
    def call():
        os.environ.update(env)
        sys.argv = [tfpar.train.__file__, *argv]
        tfpar.train.run()
    return call


def main():
    cases, folder = json.loads(sys.argv[1]), sys.argv[2]
    results = run_forked([command_line(c["argv"], c.get("env") or {}) for c in cases], folder)
    print(json.dumps({"cases": results}), flush=True)


if __name__ == "__main__":
    main()
