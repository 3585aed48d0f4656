"""Child for tests/test_faults.py: `python tests/save_pause_child.py`. Prints one JSON line.

`tfpar.faults.pause_in_save` with `TFPAR_INJECT_SAVE_PAUSE="7:60:until_sigterm"` in this
process's main thread, a SIGTERM sent 0.3 s in by another thread: how long the pause took,
what this process's own SIGTERM handler received, whether that handler is set again
afterwards; then a 20 s pause whose SIGTERM is sent the moment its "pausing" line is
written to stderr (as a launcher that waits for the line would): how long that took; and
the line a plan with an unknown word is refused with.
"""

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar import faults  # noqa: E402
from tfpar.errors import ConfigError  # noqa: E402


def main():
    received = []

    def handler(signum, frame):
        received.append(signum)
    signal.signal(signal.SIGTERM, handler)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    began = time.monotonic()
    faults.pause_in_save(7, environ={faults.SAVE_PAUSE_ENV: "7:60:until_sigterm"})
    seconds = time.monotonic() - began

    class SignalOnLine:  # stderr that sends the SIGTERM on the pause's line
        def write(self, text):
            if "pausing" in text:
                os.kill(os.getpid(), signal.SIGTERM)
            return len(text)

        def flush(self):
            pass
    sys.stderr, stderr = SignalOnLine(), sys.stderr
    began = time.monotonic()
    try:
        faults.pause_in_save(7, environ={faults.SAVE_PAUSE_ENV: "7:20:until_sigterm"})
    finally:
        sys.stderr = stderr
    on_line = time.monotonic() - began
    try:
        faults.pause_in_save(7, environ={faults.SAVE_PAUSE_ENV: "7:60:until_sigterms"})
        refused = None
    except ConfigError as e:
        refused = str(e)
    print(json.dumps({"seconds": seconds, "on_line": on_line, "received": received,
                      "handler_back": signal.getsignal(signal.SIGTERM) is handler,
                      "refused": refused}), flush=True)


if __name__ == "__main__":
    main()
