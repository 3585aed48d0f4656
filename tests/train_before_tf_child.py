"""Child process for tests/test_train.py: `python tests/train_before_tf_child.py`, run with
a TF_CONFIG of two workers in a new interpreter.

Runs `python -m tfpar.train --steps=1 --strategy=one_device` in this process
(`tfpar.train.run()`), which contradicts TF_CONFIG; prints one JSON line: the exit code and
whether TensorFlow was imported before the error.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpar.train  # noqa: E402

sys.argv = ["tfpar.train", "--steps=1", "--strategy=one_device"]
try:
    tfpar.train.run()
except SystemExit as exit_:
    print(json.dumps({"code": exit_.code, "tensorflow": "tensorflow" in sys.modules}))
