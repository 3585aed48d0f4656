"""Child for tests/test_multihost_shrink.py: a worker of a job whose host `CUT` (an address)
is cut off, without TensorFlow.

`python tests/host_cut_child.py CUT NAMED [DOWN [signal]]`: host CUT stays down for the
first DOWN attempts (`TFPAR_RESTART`; default 1). In attempt 0 a worker on another host prints
TensorFlow's heartbeat error naming the tasks NAMED (comma-separated indices, as a
traceback does: one task a line) and exits 1; a worker on CUT exits 1 with no names (its
peers went silent). In later attempts while CUT is down every worker fails at start-up as
the trainer's watchdog ends it (`tfpar.strategy`: its one line, then SIGKILL), naming no
task. Attempts after that exit 0. With `signal`, attempt 0's workers on the other hosts,
having set their SIGTERM handler (each makes a file the CUT workers wait for before
failing: a worker still starting had died of the launcher's SIGTERM instead), print their
names, wait for the launcher's SIGTERM and pass it back to the launcher (their parent)
before they exit 1: a signal that reaches the launcher while it stops a failed attempt.
"""

import json
import os
import signal
import sys
import tempfile
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
        if passing:  # fail only once the others pass the launcher's SIGTERM back
            others = [w for w in workers if w.rsplit(":", 1)[0] != cut]
            end = time.monotonic() + 60
            while (not all(os.path.exists(_ready(w)) for w in others)
                   and time.monotonic() < end):
                time.sleep(0.05)
            for w in others:  # (the launcher removes its workers' TMPDIR only when empty)
                if os.path.exists(_ready(w)):
                    os.remove(_ready(w))
        print("DeadlineExceededError: Collective ops is aborted by: Deadline Exceeded",
              flush=True)
        return 1
    if passing:
        def back(signum, frame):
            os.kill(os.getppid(), signal.SIGTERM)
            os._exit(1)
        signal.signal(signal.SIGTERM, back)
        open(_ready(me), "w").close()
    print(f"UnavailableError: {UNHEALTHY}", flush=True)  # the words TensorFlow writes
    for task in named:
        print(f"/job:worker/replica:0/task:{task}", flush=True)
    print("The tasks have crashed.", flush=True)
    if passing:
        time.sleep(60)
    return 1


def _ready(address):
    """The file a passing worker makes once its SIGTERM handler is in place (the
    addresses' ports are this attempt's own)."""
    return os.path.join(tempfile.gettempdir(), "host_cut_ready_" + address.replace(":", "_"))


if __name__ == "__main__":
    sys.exit(main())
