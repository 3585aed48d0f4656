"""Several cases of a test file in one child process (one TensorFlow start for all): the
child runs each case and reports its JSON, or its traceback when it raised, so a failing
case fails only the tests that read it. `run_cases` is the child's side; `gather` and
`case` the test file's.

`TFPAR_CASE_CPU=1 python tests/X_child.py CASE,...` also prints each case's CPU seconds in
the child (`time.process_time()`, every thread) to stderr: where a child's time goes
(docs/benchmarks/suite.md)."""

import os
import sys
import time
import traceback


def run_cases(cases, names, after=None):
    """`{name: cases[name](), or {"error": its traceback}}` for each of `names` in turn;
    `after()` (resetting what a case may leave set) runs after each."""
    out = {}
    for name in names:
        start = time.process_time()
        try:
            out[name] = cases[name]()
        except Exception:  # noqa: BLE001 - reported to the test that reads this case
            out[name] = {"error": traceback.format_exc()[-5000:]}
        finally:
            if after is not None:
                after()
            if os.environ.get("TFPAR_CASE_CPU") == "1":
                print(f"case {name}: {time.process_time() - start:.1f} CPU-s",
                      file=sys.stderr, flush=True)
    return out


def gather(children, run_child):
    """Runs `run_child(names)` for each list of case names in `children` side by side:
    `{case: its JSON, or the AssertionError its child failed with}`."""
    import subproc
    found = subproc.run_concurrently([lambda c=c: run_child(c) for c in children],
                                     keep_failures=True)
    return {name: (out if isinstance(out, AssertionError) else out[name])
            for names, out in zip(children, found) for name in names}


def case(cases, name, child):
    """Case `name`'s JSON; raises what its child (file name `child`) failed with."""
    import subproc
    result = subproc.outcome(cases[name])
    if "error" in result:
        raise AssertionError(f"{child} case {name} raised:\n{result['error']}")
    return result
