"""A bandwidth-shaped link between two network namespaces, for benchmarks (needs root).

    with ShapedLink(rate="100mbit") as link:
        link.popen(0, ["python", "worker.py"], env={...})   # runs inside namespace 0
        link.address(1)                                      # "10.200.0.2"

Two namespaces `tfpar-bench-<pid>-0/1` joined by a veth pair (MTU 1500: tbf on a 64 KiB
MTU stalls TCP), addresses 10.200.0.1 and 10.200.0.2 that exist only inside them, and a
token-bucket filter on each veth's egress, so each direction carries `rate`. Everything is
removed on exit, on an exception, on Ctrl-C and on SIGTERM (deleting a namespace deletes
its veth end, which deletes the pair); namespaces a killed earlier run left behind are
removed on the next start.

`ShapedLink(rate=None)` leaves the link unshaped (no tc needed): two "hosts" for multi-host
tests, whose link `set_link(i, up=False)` cuts.

A worker inside a namespace may change its side's rate while it runs (`reshape`, with the
filter's settings from `TFPAR_BENCH_TBF`): tools/profile_overlap.py's `--track`.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

PREFIX = "tfpar-bench-"
SUBNET = "10.200.0"


class ShapedLinkError(RuntimeError):
    """The link cannot be set up: not root, iproute2 missing, or a command failed."""


def check_tools(shaped=True):
    """Raises `ShapedLinkError` saying what to do when this machine cannot build the link."""
    if os.geteuid() != 0:
        raise ShapedLinkError("network namespaces and tc need root: run as root (sudo)")
    missing = [tool for tool in (("ip", "tc") if shaped else ("ip",))
               if shutil.which(tool) is None]
    if missing:
        raise ShapedLinkError(f"{' and '.join(missing)} not found: apt-get install -y iproute2")


def _run(*cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise ShapedLinkError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc.stdout


UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def bits_per_second(rate):
    """A tc rate in bit units ("50mbit", "12500kbit") as bits a second."""
    match = re.fullmatch(r"([0-9.]+)([kmg]?bit)", rate)
    if not match:
        raise ValueError(f"rate={rate!r} is invalid: a number and bit, kbit, mbit or gbit")
    return float(match.group(1)) * UNITS[match.group(2)]


def reshape(device, bits, tbf):
    """Sets the token-bucket filter on `device` (a veth end in the caller's own namespace)
    to `bits` a second, with `tbf`'s other settings (`TFPAR_BENCH_TBF`'s JSON)."""
    _run("tc", "qdisc", "change", "dev", device, "root", "tbf", "rate",
         f"{round(bits / 1000)}kbit", "burst", tbf["burst"], "latency", tbf["latency"])


def remove_stale():
    """Deletes namespaces of earlier runs whose process is gone (e.g. killed with -9)."""
    for line in _run("ip", "netns", "list").splitlines():
        match = re.match(rf"({re.escape(PREFIX)}(\d+)-\d)\b", line)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            subprocess.run(["ip", "netns", "del", match.group(1)], capture_output=True)


class ShapedLink:
    """Two namespaces joined by a veth pair shaped to `rate` in each direction.

    Args:
        rate: tc rate, e.g. "100mbit"; None: no shaping.
        burst, latency: tbf's bucket size and queueing limit.
        mtu: the veth MTU.
    """

    def __init__(self, rate="100mbit", burst="64kb", latency="25ms", mtu=1500):
        self.rate, self.burst, self.latency, self.mtu = rate, burst, latency, mtu
        self.namespaces = [f"{PREFIX}{os.getpid()}-{i}" for i in range(2)]
        self.devices = [f"tfv{os.getpid() % 10**8}{'ab'[i]}" for i in range(2)]
        self._previous = {}
        self.procs = []

    def address(self, i):
        """The IPv4 address of side `i` (0 or 1), reachable only from the other side."""
        return f"{SUBNET}.{i + 1}"

    def __enter__(self):
        check_tools(shaped=self.rate is not None)
        remove_stale()
        for sig in (signal.SIGTERM, signal.SIGHUP):  # clean up on kill, not only Ctrl-C
            self._previous[sig] = signal.signal(sig, _raise_interrupt)
        try:
            for ns in self.namespaces:
                _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", self.devices[0], "netns", self.namespaces[0], "type",
                 "veth", "peer", "name", self.devices[1], "netns", self.namespaces[1])
            for i, (ns, dev) in enumerate(zip(self.namespaces, self.devices)):
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu), "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", dev)
                if self.rate is not None:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                         "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def popen(self, i, cmd, **kwargs):
        """Starts `cmd` inside namespace `i` in its own process group (killed on close)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[i], *cmd],
                                start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run_workers(self, cmd, port, timeout, env=None, log_paths=None):
        """Runs `cmd` on both sides as a 2-worker `TF_CONFIG` cluster over this link and waits
        (at most `timeout` seconds; a worker that fails ends the wait). A worker finds its
        index in `TF_CONFIG`'s task, its side's veth in `TFPAR_BENCH_DEVICES` (both
        sides', comma-separated) and the filter's settings in `TFPAR_BENCH_TBF` (JSON:
        `rate`, `burst`, `latency`; `rate` null on an unshaped link).

        Args:
            log_paths: two files to keep the workers' output in (default: temporary ones).

        Returns:
            `(exit codes, the last 3000 characters of the first failed worker's output or "")`;
            a worker still running at the deadline is killed (a negative code).
        """
        cluster = [f"{self.address(i)}:{port}" for i in range(2)]
        logs, procs = [], []
        for i in range(2):
            worker_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}),
                              TFPAR_BENCH_DEVICES=",".join(self.devices),
                              TFPAR_BENCH_TBF=json.dumps({"rate": self.rate,
                                                          "burst": self.burst,
                                                          "latency": self.latency}),
                              TF_CONFIG=json.dumps({"cluster": {"worker": cluster},
                                                    "task": {"type": "worker", "index": i}}))
            # Files: a pipe could fill and stall the worker.
            logs.append(open(log_paths[i], "w+b") if log_paths else tempfile.TemporaryFile())
            procs.append(self.popen(i, cmd, env=worker_env, stdout=logs[i],
                                    stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while (any(p.poll() is None for p in procs) and not any(p.poll() for p in procs)
               and time.monotonic() < deadline):
            time.sleep(0.2)
        self.kill_all()
        codes = [p.returncode for p in procs]
        failed = [i for i, c in enumerate(codes) if c != 0]
        output = ""
        if failed:
            logs[failed[0]].seek(0)
            output = logs[failed[0]].read().decode(errors="replace")[-3000:]
        for log in logs:
            log.close()
        return codes, output

    def set_link(self, i, up=True):
        """Brings side `i`'s veth end up or down (down: that side's link is cut)."""
        _run("ip", "-n", self.namespaces[i], "link", "set", "dev", self.devices[i],
             "up" if up else "down")

    def tx_bytes(self, i):
        """Bytes sent so far by side `i`'s veth end."""
        return int(_run("ip", "netns", "exec", self.namespaces[i], "cat",
                        f"/sys/class/net/{self.devices[i]}/statistics/tx_bytes"))

    def kill_all(self):
        """SIGKILLs the process group of everything `popen` started."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        self.procs = []

    def close(self):
        """Kills the processes, deletes both namespaces (and with them the veth pair)."""
        self.kill_all()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
