"""Child process for tests/test_subproc.py: `python report.py EXIT_CODE [ARG...]` (the test
copies it to a directory of its own, the script's directory being sys.path[0]).

Prints one JSON line of what the process sees (argv, working directory, environment,
sys.path, `__name__`, whether TensorFlow is loaded, its streams' buffering), writes a line
to stderr and exits with EXIT_CODE.
"""

import json
import os
import sys

print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "mine": os.environ.get("MINE"),
                  "unset": "HOME" in os.environ, "path0": sys.path[0],
                  "extra": os.environ["PYTHONPATH"].split(os.pathsep)[0] in sys.path,
                  "main": __name__, "tensorflow": "tensorflow" in sys.modules,
                  "streams": [[s.name, s.write_through, s.line_buffering]
                              for s in (sys.stdout, sys.stderr)]}))
sys.stderr.write("to stderr\n")
sys.exit(int(sys.argv[1]))
