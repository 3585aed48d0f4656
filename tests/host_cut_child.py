"""Child for tests/test_multihost_shrink.py: a worker of a job whose host `CUT` (an address)
is cut off, without TensorFlow.

`python tests/host_cut_child.py CUT NAMED [DOWN [signal]]`: host CUT stays down for the
first DOWN attempts (`TFPAR_RESTART`; default 1). In attempt 0 a worker on another host prints
TensorFlow's heartbeat error naming the tasks NAMED (comma-separated indices, as a
traceback does: one task a line) and exits 1; a worker on CUT exits 1 with no names (its
peers went silent), but only once every worker on the other hosts has said its names (a
file each in `HOST_CUT_READY`, a directory the test owns): as in a real job, where the cut
host's collectives time out long after the heartbeat error, and without a race in which a
worker still starting on a loaded machine had not printed its names when the launcher
stopped it. In later attempts while CUT is down every worker fails at start-up as the
trainer's watchdog ends it (`tfpar.strategy`: its one line, then SIGKILL), naming no task.
Attempts after that exit 0. With `signal`, attempt 0's workers on the other hosts set
their SIGTERM handler before they say their names, then wait for the launcher's SIGTERM
and pass it back to the launcher (their parent) before they exit 1: a signal that reaches
the launcher while it stops a failed attempt.
"""

import json
import os
import signal
import sys
import time

from tfpar.host_loss import UNHEALTHY


def main():
    cut, named = sys.argv[1], [int(n) for n in sys.argv[2].split(",") if n]
    down = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    attempt = int(os.environ["TFPAR_RESTART"])
    if attempt >= down:
        return 0
    config = json.loads(os.environ["TF_CONFIG"])
    if attempt > 0:
        print("tfpar: error: workers did not all start within startup_timeout_s=60: is "
              f"every worker of {config['cluster']['worker']} started?", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    workers = config["cluster"]["worker"]
    me = workers[config["task"]["index"]]
    passing = sys.argv[4:] == ["signal"]
    if me.rsplit(":", 1)[0] == cut:
        others = [w for w in workers if w.rsplit(":", 1)[0] != cut]
        end = time.monotonic() + 60
        while (not all(os.path.exists(_ready(w)) for w in others)
               and time.monotonic() < end):
            time.sleep(0.05)
        print("DeadlineExceededError: Collective ops is aborted by: Deadline Exceeded",
              flush=True)
        return 1
    if passing:
        def back(signum, frame):
            os.kill(os.getppid(), signal.SIGTERM)
            os._exit(1)
        signal.signal(signal.SIGTERM, back)
    print(f"UnavailableError: {UNHEALTHY}", flush=True)  # the words TensorFlow writes
    for task in named:
        print(f"/job:worker/replica:0/task:{task}", flush=True)
    print("The tasks have crashed.", flush=True)
    open(_ready(me), "w").close()
    if passing:
        time.sleep(60)
    return 1


def _ready(address):
    """The file a worker on another host makes once it has said its names (and set its
    SIGTERM handler, with `signal`); the addresses' ports are this attempt's own."""
    return os.path.join(os.environ["HOST_CUT_READY"], address.replace(":", "_"))


if __name__ == "__main__":
    sys.exit(main())
