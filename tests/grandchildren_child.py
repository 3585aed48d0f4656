"""Child process for tests/test_subproc.py: `python tests/grandchildren_child.py`.

Starts Python grandchildren the way `tfpar.launch` starts workers (`Popen([sys.executable,
...], start_new_session=True)`, pipes, poll, wait with a timeout, kill), one in its own
session and one in this one, and prints one JSON line of what it saw of them.
"""

import json
import os
import select
import subprocess
import sys
import time

import psutil

me = os.getpid()


def line_and_more(fd, seconds):  # a line and what follows it, as far as `seconds` allow
    data, end = b"", time.monotonic() + seconds
    while not data.partition(b"\n")[2]:
        if not select.select([fd], [], [], max(0, end - time.monotonic()))[0]:
            break
        chunk = os.read(fd, 100)
        if not chunk:
            break
        data += chunk
    return data.decode()


p = subprocess.Popen(
    [sys.executable, "-c", "import sys, time; print('tensorflow' in sys.modules, flush=True); "
     "sys.stdout.write('x'); time.sleep(60)"],
    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    env=dict(os.environ, PYTHONUNBUFFERED="1"))
# The 'x' is never flushed: it arrives before the 60 s sleep ends only when unbuffered.
loaded, _, unflushed = line_and_more(p.stdout.fileno(), 20).partition("\n")
parent = psutil.Process(p.pid).ppid()
try:
    p.wait(timeout=0.3)
    timed_out = False
except subprocess.TimeoutExpired:
    timed_out = True
polled = p.poll()
p.kill()
killed = p.wait()
ended = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"],
                         start_new_session=True)
# Once it has ended, and until it is waited for, it is a zombie (its pid is not reused).
zombie, end = False, time.monotonic() + 30
while not zombie and time.monotonic() < end:
    try:
        zombie = psutil.Process(ended.pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # reaped before the wait
        break
    time.sleep(0.05)
exited = ended.wait()
try:
    subprocess.Popen([sys.executable, "-c", "pass"], cwd="/nonexistent/dir",
                     start_new_session=True)
    missing_cwd = None
except FileNotFoundError as e:
    missing_cwd = e.filename
upper = subprocess.run([sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"],
                       input="abc", capture_output=True, text=True,
                       start_new_session=True).stdout.strip()
same_session = subprocess.run([sys.executable, "-c", "import os; print(os.getppid())"],
                              capture_output=True, text=True).stdout.strip()
print(json.dumps({"loaded": loaded, "unflushed": unflushed, "routed": parent != me,
                  "timed_out": timed_out, "polled": polled, "killed": killed,
                  "exited": exited, "zombie": zombie, "missing_cwd": missing_cwd,
                  "upper": upper, "same_session": same_session == str(me)}))
