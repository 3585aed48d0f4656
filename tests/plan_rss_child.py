"""Runs one command and prints JSON {seconds, max_rss_mb, returncode}: its wall time and the
peak resident memory of its process tree (this process has no other children)."""

import json
import resource
import subprocess
import sys
import time

began = time.perf_counter()
out = subprocess.run(sys.argv[1:], capture_output=True, text=True)
seconds = time.perf_counter() - began
rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: kilobytes
print(json.dumps({"seconds": seconds, "max_rss_mb": rss_kb / 1024,
                  "returncode": out.returncode, "stdout": out.stdout[:200],
                  "stderr": out.stderr[-2000:]}))
