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
- the probe: once the attempt's workers are stopped, the launcher connects to every
  worker port of every host at once (`probe_hosts`); a host whose ports refuse is up, one
  that gives no reply or has no route is unreachable (`answered`).

`lost_host` decides from both: the pure rule, unit-tested without a network.
"""

import dataclasses
import errno
import re
import socket
import threading


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


# A connect's errors that mean nothing answered at the host (no route, the host down, no
# reply in time); a refusal or a reset is an answer (the host is up, its port closed).
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT}


def answered(error):
    """True if a TCP connect that ended with `error` (None: it connected) reached its host,
    False if it did not (a timeout, no route), None if it cannot tell (e.g. a name that
    does not resolve)."""
    if error is None or isinstance(error, (ConnectionRefusedError, ConnectionResetError)):
        return True
    if isinstance(error, TimeoutError) or getattr(error, "errno", None) in _UNREACHABLE:
        return False
    return None


def probe_hosts(addresses, timeout=2.0):
    """`{host: True, False or None}` for the worker addresses ("HOST:PORT", IPv6 as
    "[::1]:PORT"): a TCP connect to each, all at once, waiting at most `timeout` s; a host
    answered if one of its addresses accepted or refused, is unreachable if none did and
    at least one timed out or found no route (`answered`), else unknown (None). Called
    after the attempt's workers were stopped, so a live host's ports refuse."""
    results = {}

    def connect(address):
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                error = None
        except OSError as e:
            error = e
        results[address] = (host.strip("[]"), answered(error))

    threads = [threading.Thread(target=connect, args=(a,), daemon=True) for a in addresses]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)  # a name lookup may take longer; unknown if it does
    by_host = {}
    for address in addresses:
        host, answer = results.get(address, (address.rpartition(":")[0].strip("[]"), None))
        by_host.setdefault(host, []).append(answer)
    return {host: True if True in found else False if False in found else None
            for host, found in by_host.items()}
