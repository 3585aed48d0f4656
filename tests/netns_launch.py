"""Child for tests: `python tests/netns_launch.py SPEC_JSON -- CMD...`.

Runs `tfpar.launch.launch(CMD, **SPEC["launch"])` with a runner that starts each worker
inside the network namespace standing in for its host, and exits with the launch's return
code: forked from the host's fork server (`subproc.fork_server_under`, started inside the
namespace: TensorFlow imported once a host) when SPEC names one and the worker's
environment suits it, else `ip netns exec NS CMD` (the worker's process is CMD itself).
SPEC: {"namespaces": {host address: namespace}, "hosts": [[address, slots], ...],
"launch": {keyword arguments of `launch`}, optional "servers": {host address: socket},
"server_env": {the servers' import-time variables}}.
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import zygote  # noqa: E402

from tfpar.launch import launch  # noqa: E402


def main():
    split = sys.argv.index("--")
    spec, cmd = json.loads(sys.argv[1]), sys.argv[split + 1:]
    namespaces, servers = spec["namespaces"], spec.get("servers", {})

    def netns_runner(host, worker_cmd, env, **popen_kwargs):
        server = servers.get(host)
        if server is None or not zygote.accepts(spec["server_env"], worker_cmd, env):
            return subprocess.Popen(["ip", "netns", "exec", namespaces[host], *worker_cmd],
                                    env=env, **popen_kwargs)
        proc = zygote.popen_class(server, spec["server_env"])(worker_cmd, env=env,
                                                               **popen_kwargs)
        if getattr(proc, "_zygote", None) is None:  # exec'd: outside the host's namespace
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the fork server of {namespaces[host]} did not answer")
        return proc

    hosts = [tuple(h) for h in spec["hosts"]]
    result = launch(cmd, sum(n for _, n in hosts), hosts=hosts, runner=netns_runner,
                    **spec.get("launch", {}))
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
