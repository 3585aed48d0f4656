"""Child process for tests/test_train.py and tests/test_rulebook.py:
`python tests/train_before_tf_child.py FLAG...`, run in a new interpreter.

Runs `python -m tfpar.train FLAG...` in this process (`tfpar.train.run()`) with a command
line the tests expect to be refused; prints one JSON line: the exit code and whether
TensorFlow was imported before the error.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpar.train  # noqa: E402

sys.argv = ["tfpar.train", *sys.argv[1:]]
try:
    tfpar.train.run()
except SystemExit as exit_:
    print(json.dumps({"code": exit_.code, "tensorflow": "tensorflow" in sys.modules}))
