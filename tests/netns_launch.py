"""Child for tests: `python tests/netns_launch.py SPEC_JSON -- CMD...`.

Runs `tfpar.launch.launch(CMD, **SPEC["launch"])` with a runner that starts each worker
inside the network namespace standing in for its host (`ip netns exec NS CMD`, so the
worker's process is CMD itself), and exits with the launch's return code.
SPEC: {"namespaces": {host address: namespace}, "hosts": [[address, slots], ...],
"launch": {keyword arguments of `launch`}}.
"""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar.launch import launch  # noqa: E402


def main():
    split = sys.argv.index("--")
    spec, cmd = json.loads(sys.argv[1]), sys.argv[split + 1:]
    namespaces = spec["namespaces"]

    def netns_runner(host, worker_cmd, env, **popen_kwargs):
        return subprocess.Popen(["ip", "netns", "exec", namespaces[host], *worker_cmd],
                                env=env, **popen_kwargs)

    hosts = [tuple(h) for h in spec["hosts"]]
    result = launch(cmd, sum(n for _, n in hosts), hosts=hosts, runner=netns_runner,
                    **spec.get("launch", {}))
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
