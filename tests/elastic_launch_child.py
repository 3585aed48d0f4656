"""Stand-ins of tests/test_elastic_launch.py's elastic launcher tests (no TensorFlow):
`python tests/elastic_launch_child.py worker STATE_DIR` prints what the trainer prints;
`python tests/elastic_launch_child.py discovery STATE_DIR` is the discovery script.

The worker: slot LOSE_SLOT fails in attempt 0; a lone worker touches STATE_DIR/lost (the
discovery script then stops listing slot 1, once); attempt LAST_ATTEMPT ends with 0, the
others sleep until the launcher stops them (SIGTERM) to grow.
"""

import os
import pathlib
import signal
import sys
import time


def worker(state):
    slot, n, attempt = (os.environ[k] for k in ("TFPAR_SLOT", "TFPAR_NUM_WORKERS",
                                                "TFPAR_RESTART"))
    print("TFPAR_READY", flush=True)
    if attempt != "0":
        print(f"world size changed at step {attempt}0", flush=True)
    if os.environ.get("LOSE_SLOT") == slot and attempt == "0":
        sys.exit(3)

    def stop(*_):
        print(f"tfpar: stopping at step {attempt}5 on SIGTERM: checkpoint saved", flush=True)
        sys.exit(143)

    # Before the touch below: the launcher may stop this worker to grow 0.1 s after it.
    signal.signal(signal.SIGTERM, stop)
    if n == "1":
        (state / "lost").touch()  # the discovery script now stops listing slot 1, once
    if attempt == os.environ["LAST_ATTEMPT"]:
        sys.exit(0)
    time.sleep(60)  # until the launcher stops it to grow
    sys.exit(5)


def discovery(state):
    if (state / "lost").exists() and not (state / "seen").exists():
        (state / "seen").touch()
        print("127.0.0.1:1")
    else:
        print("127.0.0.1:2")


if __name__ == "__main__":
    {"worker": worker, "discovery": discovery}[sys.argv[1]](pathlib.Path(sys.argv[2]))
