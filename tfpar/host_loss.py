"""A whole host lost at once: how `tfpar.launch` tells a host cut off from a lost worker.

When a host's link is cut (or the machine is gone) every worker of the job fails in a
collective, and the first to exit is as likely on a healthy host. Two kinds of evidence
name the host instead:

- the names: TensorFlow's coordination service names the tasks whose heartbeats stopped
  ("The following tasks are unhealthy (stopped sending heartbeats):", `UNHEALTHY`), read
  from each worker's output by `Unhealthy`; the other hosts' workers naming all of a host's
  workers, and only those, settle it (`cut_off_host`). But the service checks once a
  second and names at most 3 tasks a check, each worker's heartbeat on its own clock, so a
  host of several workers may be named only in part, and an attempt failing at start-up
  (the host still down) names none.
- the probe: once the attempt's workers are stopped, the launcher connects to a host's
  first worker ports on every address its name resolves to, all hosts at once, within one
  deadline (`probe_hosts`); a host whose ports refuse is up, one that gives no reply or has
  no route is unreachable (`answered`). The launcher checks each host not yet trusted
  before an attempt's workers start, its ports closed then: a host that answers is trusted;
  "unreachable" after a failure counts from a trusted host, or from one that gave no reply
  before that attempt started too (dead at launch; a firewall dropping connections to
  closed ports looks the same: `--probe_timeout=0`).

`lost_host` decides from both: the pure rule, unit-tested without a network. When it finds
no host lost whole, the names still point at a worker (`named_worker`).
"""

import dataclasses
import errno
import re
import socket
import threading
import time


@dataclasses.dataclass(frozen=True)
class LostHost:
    """Every worker slot of `host` (`slots`) cut off at once: what an attempt blames when
    the workers of the other hosts all named that host's workers, and only those, as
    unhealthy (TensorFlow's coordination service: "stopped sending heartbeats"), or when
    the host did not answer the launcher's probe while another host did (`lost_host`)."""

    host: str
    slots: tuple


# TensorFlow's coordination service's words for workers whose heartbeats stopped
# (tensorflow 2.21.0; `tfpar.patches.multi_worker`'s entry `heartbeat_error_text` checks
# its library still holds them, so a rewording fails the registry, not this quietly).
UNHEALTHY = "The following tasks are unhealthy (stopped sending heartbeats):"
_TASK = r"/job:worker(?:/replica:\d+)?/task:(\d+)"
_TASKS = re.compile(rf"^(?:\s|,|\\n)*{_TASK}(?:(?:\s|,|\\n)*{_TASK})*")


class Unhealthy:
    """The task indices one worker's output names as unhealthy (TensorFlow's "The following
    tasks are unhealthy (stopped sending heartbeats):" and the task names after it, on the
    same line, escaped, or on the lines that follow, as in a traceback)."""

    def __init__(self):
        self.tasks, self._listing = set(), False

    def read(self, line):
        if UNHEALTHY in line:
            rest = line.split(UNHEALTHY, 1)[1]
            self._listing = not self._take(rest)
        elif self._listing:
            self._listing = self._take(line)
        return self

    def _take(self, text):
        match = _TASKS.match(text)
        if match:
            self.tasks.update(int(t) for t in re.findall(_TASK, match.group(0)))
        return match is not None


def cut_off_host(hosts, unhealthy):
    """The one host all of whose workers, and no others, the other hosts' workers named as
    unhealthy (`unhealthy[i]`: the indices worker i named; a worker killed before its line
    names none); None if no host, or more than one, is named so (one host only, a single
    worker of a host named, names of both sides of a cut link)."""
    if len(set(hosts)) < 2:
        return None
    named = []
    for host in dict.fromkeys(hosts):
        members = {i for i, h in enumerate(hosts) if h == host}
        if set().union(*(unhealthy[i] for i in range(len(hosts))
                         if i not in members)) == members:
            named.append(host)
    return named[0] if len(named) == 1 else None


def lost_host(hosts, unhealthy, answers=None):
    """The host a failed attempt lost whole, and the evidence: `(host, "named")`,
    `(host, "probe")` or `(None, "")`.

    Args:
        hosts: the host of each worker of the attempt.
        unhealthy: per worker, the worker indices it named as unhealthy.
        answers: `{host: True, False or None}` from the launcher's probe (`probe_hosts`:
            answered, unreachable, unknown), or None when no probe ran.

    The other hosts' workers naming all of a host's workers, and only those, is enough
    (`cut_off_host`). Otherwise the names cannot tell a host from a worker (TensorFlow
    names at most 3 stale tasks a check, a start-up failure none), and the probe decides:
    the one host that did not answer, if another host did (none answering says more about
    the launcher's own link than the hosts'). A host that answered, even with a refusal,
    is up: its failed worker is a lost worker, not a lost host. Two hosts unreachable at
    once lose neither as a unit (each slot is counted as before).
    """
    named = cut_off_host(hosts, unhealthy)
    if named is not None:
        return named, "named"
    if not answers or len(set(hosts)) < 2:
        return None, ""
    unreachable = [h for h in dict.fromkeys(hosts) if answers.get(h) is False]
    if len(unreachable) == 1 and any(answers.get(h) for h in hosts):
        return unreachable[0], "probe"
    return None, ""


def named_worker(hosts, unhealthy):
    """The worker a failed attempt that lost no host whole is counted against, by the
    names: the lowest-index task the workers named as unhealthy (a worker naming itself
    aside), when every task named is on one host; None if none was named, or tasks of
    several hosts were (then the names do not point at one place)."""
    names = set().union(set(), *(tasks - {i} for i, tasks in enumerate(unhealthy)))
    if not names or len({hosts[i] for i in names}) != 1:
        return None
    return min(names)


# A connect's errors that mean nothing answered at the host (no route, the host down, no
# reply in time); a refusal or a reset is an answer (the host is up, its port closed). A
# firewall that rejects with ICMP "host prohibited" (EHOSTUNREACH) looks the same: a live
# host behind it looks cut off (`--probe_timeout=0`).
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT}

PORTS_PER_HOST = 2  # a host's first ports probed: one answering is enough


def answered(error):
    """True if a TCP connect that ended with `error` (None: it connected) reached its host,
    False if it did not (a timeout, no route), None if it cannot tell (e.g. a name that
    does not resolve)."""
    if error is None or isinstance(error, (ConnectionRefusedError, ConnectionResetError)):
        return True
    if isinstance(error, TimeoutError) or getattr(error, "errno", None) in _UNREACHABLE:
        return False
    return None


def combined(found):
    """One host's answer from its connects' (`answered`): True if any reached it, else
    False if any timed out or found no route, else None (unknown; no connect at all)."""
    return True if True in found else False if False in found else None


def probe_hosts(addresses, timeout=3.5):
    """`{host: True, False or None}` for the worker addresses ("HOST:PORT", IPv6 as
    "[::1]:PORT"), all within `timeout` s in all: each host's name is resolved once, then
    its first `PORTS_PER_HOST` ports are connected to on every address the name resolves
    to, all at once. A host answered if any connect was accepted or refused, is
    unreachable if none was and one found no route or had no reply in half the time or
    more (timed out, or still waiting at the deadline; `answered`), else unknown (None:
    the name did not resolve in time, or so late that its connects had too little time).
    Called when the hosts' worker ports are closed (before the workers start, after they
    were stopped), so a live host's ports refuse."""
    if not (0 < timeout < float("inf")):
        raise ValueError(f"probe_hosts: timeout must be a finite number > 0, not {timeout!r}")
    deadline = time.monotonic() + timeout
    ports = {}  # host: its first ports
    for address in addresses:
        host, _, port = address.rpartition(":")
        ports.setdefault(host.strip("[]"), [])
        if len(ports[host.strip("[]")]) < PORTS_PER_HOST:
            ports[host.strip("[]")].append(int(port))
    found = {host: [] for host in ports}  # each connect's `answered`, as it ends
    connects = {host: [] for host in ports}  # their threads, started by the host's resolver

    def left():
        return max(deadline - time.monotonic(), 0.0)

    def connect(host, family, sockaddr, window):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(max(window, 0.001))
                sock.connect(sockaddr)
            error = None
        except OSError as e:
            error = e
        # No reply in less than half the time (its name was slow to resolve) says nothing.
        short = isinstance(error, TimeoutError) and window < timeout / 2
        found[host].append(None if short else answered(error))

    def resolve(host):
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return  # unknown
        for family, sockaddr in dict.fromkeys((info[0], info[4]) for info in infos):
            for port in ports[host]:
                window = left()
                thread = threading.Thread(target=connect, daemon=True, args=(
                    host, family, (sockaddr[0], port) + sockaddr[2:], window))
                connects[host].append((thread, window))
                thread.start()

    resolvers = {h: threading.Thread(target=resolve, args=(h,), daemon=True) for h in ports}
    for thread in resolvers.values():
        thread.start()
    for thread in resolvers.values():
        thread.join(left())
    answers = {}
    for host, resolver in resolvers.items():
        if resolver.is_alive():  # its name still resolving at the deadline
            answers[host] = True if True in found[host] else None
            continue
        for thread, _ in connects[host]:
            thread.join(left())
        # A connect still waiting at the deadline had no reply: as a timeout (if it was
        # given half the time or more).
        waiting = any(thread.is_alive() and window >= timeout / 2
                      for thread, window in connects[host])
        answers[host] = combined(list(found[host]) + [False] * waiting)
    return answers
