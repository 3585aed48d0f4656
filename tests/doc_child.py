"""Child process for tests: `python tests/doc_child.py tfpar.NAME` runs the docstring
examples of one public name (in a fresh process: they build strategies) and exits 1 if
any fails or there is none."""

import doctest
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    dotted = sys.argv[1]
    module, _, attr = dotted.rpartition(".")
    obj = getattr(importlib.import_module(module), attr)
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


if __name__ == "__main__":
    main()
