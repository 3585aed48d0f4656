"""Workers of tests/test_launch.py, started by `tfpar.launch` (no TensorFlow):
`python tests/launch_child.py CASE [ARG...]`.

Each CASE is a function below; what it does depends on the variables the launcher gives a
worker (TFPAR_WORKER_INDEX, TFPAR_NUM_WORKERS, TFPAR_RESTART, TFPAR_SLOT). JSON lines on
stdout are what the test reads back.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def report_env():
    """Prints the launcher's variables as one JSON line, and a line to stderr."""
    print(json.dumps({k: os.environ[k] for k in
                      ("TF_CONFIG", "TFPAR_WORKER_INDEX", "TFPAR_NUM_WORKERS",
                       "TFPAR_RESTART")}))
    print("to stderr", file=sys.stderr)


def fail_once_started(flag):
    """Worker 0 exits 3 once worker 1 (which starts a `sleep` child and sleeps) has written
    FLAG after printing its own and its child's pid."""
    if os.environ["TFPAR_WORKER_INDEX"] == "0":
        while not os.path.exists(flag):  # fail only once worker 1 has reported
            time.sleep(0.05)
        sys.exit(3)
    child = subprocess.Popen(["sleep", "60"])
    print(json.dumps({"pid": os.getpid(), "child": child.pid}))
    open(flag, "w").close()
    time.sleep(60)


def killed():
    """Worker 1 SIGKILLs itself; the others sleep."""
    if os.environ["TFPAR_WORKER_INDEX"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def ready_on_zero():
    """Only worker 0 prints TFPAR_READY; all sleep."""
    if os.environ["TFPAR_WORKER_INDEX"] == "0":
        print("strategy built: TFPAR_READY")
    time.sleep(60)


def restart(flag):
    """Attempt 0: worker 0 exits 3 once worker 1 has printed its attempt and written FLAG.
    Attempt 1: both end with 0."""
    attempt = int(os.environ["TFPAR_RESTART"])
    if os.environ["TFPAR_WORKER_INDEX"] == "0":
        while attempt == 0 and not os.path.exists(flag):
            time.sleep(0.05)
        sys.exit(3 if attempt == 0 else 0)
    print('{"attempt": %d}' % attempt)
    open(flag, "w").close()
    time.sleep(60 if attempt == 0 else 0.2)


def lost_slot():
    """Slot 2 fails in every attempt (its machine is gone); the others report and end."""
    slot, attempt = os.environ["TFPAR_SLOT"], int(os.environ["TFPAR_RESTART"])
    if slot == "2":
        sys.exit(3)
    if os.environ["TFPAR_NUM_WORKERS"] == "3":
        time.sleep(60)  # the survivors train until slot 2's failure stops the attempt
    print(json.dumps({"slot": slot, "index": os.environ["TFPAR_WORKER_INDEX"],
                      "workers": os.environ["TFPAR_NUM_WORKERS"], "attempt": attempt}))
    print("tfpar: world size changed at step 7: 2 worker(s)", file=sys.stderr)


def names_a_silent_worker():
    """Attempt 0: worker 0 names worker 2 (which sleeps: alive, silent) as not answering
    and exits 1; worker 1 sleeps. Later attempts end at once."""
    if os.environ["TFPAR_RESTART"] != "0":
        print(json.dumps({"slot": os.environ["TFPAR_SLOT"]}))
        return
    if os.environ["TFPAR_WORKER_INDEX"] == "0":
        print("tfpar: error: pipeline worker 2 did not answer\nTFPAR_LOST_WORKER 2",
              flush=True)
        sys.exit(1)
    time.sleep(60)


def note_pid(folder):
    """Writes a file named by its pid into FOLDER, then sleeps."""
    open(os.path.join(folder, str(os.getpid())), "w").close()
    print("started", flush=True)
    time.sleep(60)


def leaves_temp_files(*args):
    """Writes what autograph writes per converted function into the temporary directory
    (removed at exit, unless killed); worker 1 with `keep` also writes a file of the user's.
    Prints the temporary directory."""
    folder = tempfile.gettempdir()
    name = "__autograph_generated_file%s.py" % os.environ["TFPAR_WORKER_INDEX"]
    open(os.path.join(folder, name), "w").close()
    if os.environ["TFPAR_WORKER_INDEX"] == "1" and list(args) == ["keep"]:
        with open(os.path.join(folder, "notes.txt"), "w") as f:
            f.write("the user's own")
    print(json.dumps({"tmp": folder}))


CASES = {f.__name__: f for f in (report_env, fail_once_started, killed, ready_on_zero,
                                 restart, lost_slot, names_a_silent_worker, note_pid,
                                 leaves_temp_files)}

if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
