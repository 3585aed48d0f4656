"""Child process for tests: `python tests/doc_child.py OUT_DIR [--tensorboard=LOG_ROOT]
tfpar.NAME...` runs the docstring examples of each public name in a process of its own
(they build strategies: one per process), forked from this one (tests/forking.py:
TensorFlow imported once), two at a time. A name's process exits 1 if any example fails or
there is none. First, before anything imports TensorFlow, it checks what `import tfpar`
loads (`import_check`). With `--tensorboard`, tests/tensorboard_child.py's run is forked
too, writing under LOG_ROOT. Prints one JSON line `{"names": {name: {"returncode",
"stdout", "stderr", "seconds"}}, "import_check": [line, line]}`, and `"tensorboard"` (its
fork's result) with `--tensorboard`."""

import doctest
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forking import run_forked  # noqa: E402


def run_examples(dotted, obj):
    def call():
        tests = doctest.DocTestFinder(recurse=False).find(obj, dotted, globs={})
        examples = sum(len(t.examples) for t in tests)
        if not examples:
            print(f"{dotted}: no docstring examples")
            sys.exit(1)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in tests:
            runner.run(test)
        result = runner.summarize(verbose=False)
        print(f"{dotted}: {result.attempted} examples, {result.failed} failed")
        sys.exit(1 if result.failed else 0)
    return call


def import_check():
    """What `import tfpar` loads (no TensorFlow, no Keras), then where `tfpar.make_strategy`
    comes from and whether TensorFlow is loaded after that access: two lines of text."""
    import tfpar
    lines = [str(sorted(m for m in ("tensorflow", "keras") if m in sys.modules))]
    lines.append(f"{tfpar.make_strategy.__module__} {'tensorflow' in sys.modules}")
    return lines


def tensorboard_run(log_root):
    import tensorboard_child

    def call():
        sys.argv = [tensorboard_child.__file__, log_root]
        tensorboard_child.main()
    return call


def main():
    folder, names = sys.argv[1], sys.argv[2:]
    log_root = None
    if names and names[0].startswith("--tensorboard="):
        log_root, names = names[0].split("=", 1)[1], names[1:]
    first_import = import_check()  # before anything here imports TensorFlow
    calls = []
    for dotted in names:
        module, _, attr = dotted.rpartition(".")
        calls.append(run_examples(dotted, getattr(importlib.import_module(module), attr)))
    if log_root:
        calls.append(tensorboard_run(log_root))
    results = run_forked(calls, folder)
    out = {"names": dict(zip(names, results)), "import_check": first_import}
    if log_root:
        out["tensorboard"] = results[-1]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
