"""Child for tests/test_multihost_shrink.py: a worker of a job whose host `CUT` (an address)
is cut off in attempt 0, without TensorFlow.

`python tests/host_cut_child.py CUT NAMED`: in attempt 0 (`TFPAR_RESTART`) a worker on
another host prints TensorFlow's heartbeat error naming the tasks NAMED (comma-separated
indices, as a traceback does: one task a line) and exits 1; a worker on CUT exits 1 with
no names (its peers went silent). Later attempts exit 0.
"""

import json
import os
import sys

from tfpar.launch import UNHEALTHY


def main():
    cut, named = sys.argv[1], [int(n) for n in sys.argv[2].split(",") if n]
    if os.environ["TFPAR_RESTART"] != "0":
        return 0
    config = json.loads(os.environ["TF_CONFIG"])
    me = config["cluster"]["worker"][config["task"]["index"]]
    if me.rsplit(":", 1)[0] == cut:
        print("DeadlineExceededError: Collective ops is aborted by: Deadline Exceeded",
              flush=True)
        return 1
    print(f"UnavailableError: {UNHEALTHY}", flush=True)  # the words TensorFlow writes
    for task in named:
        print(f"/job:worker/replica:0/task:{task}", flush=True)
    print("The tasks have crashed.", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
