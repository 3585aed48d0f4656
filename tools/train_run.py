"""One `python -m tfpar.train` run in a child process, for the benchmarks that compare
settings run by run (`bench_3d`, `bench_memory`): its metrics JSON, or the last line
tfpar printed when it failed."""

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(flag_list, timeout, env_extra=None):
    """Runs `python -m tfpar.train FLAGS --verbose=0` with the CPU allocator's BFC on (the
    memory figures need it) and no inherited `TF_CONFIG`. Returns `(metrics, error,
    seconds)`: the metrics JSON and None, or None and one line (tfpar's last line, the
    last line of stderr, the exit status, or the timeout)."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(env_extra or {}))
    env.pop("TF_CONFIG", None)
    began = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.json")
        cmd = [sys.executable, "-m", "tfpar.train", "--verbose=0", f"--metrics_json={path}",
               *flag_list]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout} s", time.time() - began
        seconds = time.time() - began
        if proc.returncode != 0 or not os.path.exists(path):
            lines = [l for l in proc.stderr.splitlines() if l.startswith("tfpar")]
            last = lines or proc.stderr.splitlines()[-1:] or [f"exit {proc.returncode}"]
            return None, last[-1][:400], seconds
        with open(path) as f:
            return json.load(f), None, seconds
