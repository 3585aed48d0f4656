"""One worker of tests/test_barrier.py, started by `python -m tfpar.launch --workers=2`.

Usage: barrier_child.py MODE. Builds the multi-worker strategy, then:
  late:    worker 1 sleeps 3 s before `tfpar.wait_for_workers("t", timeout_s=60)`; every
           worker prints when it called and when it returned (wall clock, one machine).
           Worker 1 also has the barrier's answer 1 s late (as when the answer is still on
           the wire as worker 0 exits) and prints when it had it ("answered").
  missing: worker 1 sleeps 8 s and exits without the barrier; worker 0 waits with
           `timeout_s=2` and prints the error it got (or that it returned).
One JSON line per worker: {"worker", "called", "returned", "waited", "error"} (and
"answered").
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpar  # noqa: E402
from tfpar import patches  # noqa: E402


def main():
    mode = sys.argv[1]
    worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    tfpar.make_strategy(kind="multi_worker", collective_timeout_s=60)
    out = {"worker": worker, "waited": None, "error": None}
    if worker == 1:
        time.sleep(3 if mode == "late" else 8)
    if worker == 1 and mode == "late":
        barrier = patches.wait_at_barrier

        def late_answer(barrier_id, timeout_s):
            waited = barrier(barrier_id, timeout_s)
            if "answered" not in out:
                time.sleep(1.0)
                out["answered"] = time.time()
            return waited

        patches.wait_at_barrier = late_answer
    out["called"] = time.time()
    if mode == "late" or worker == 0:
        try:
            out["waited"] = tfpar.wait_for_workers("t", timeout_s=60 if mode == "late" else 2)
        except tfpar.TfparError as err:
            out["error"] = str(err)
    out["returned"] = time.time()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
