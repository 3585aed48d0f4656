"""`python -m tfpar.launch --workers=N -- CMD...`: N local workers, each with its own TF_CONFIG.

What `torchrun` is to PyTorch. Worker i runs CMD in its own process group with
    TF_CONFIG           a worker-only cluster on N free ports of --host, task index i
    TFPAR_WORKER_INDEX  i
    TFPAR_NUM_WORKERS   N
    TFPAR_RESTART       the attempt number, 0 on the first start
    TFPAR_ELASTIC       1 in an elastic job (a mesh's degrees, a pipeline's stages follow the
                        world: tfpar.relayout)
Output lines are prefixed `[worker i] `. When a worker fails, or a timeout expires, or the
launcher gets SIGINT/SIGTERM, every worker's process group is signalled, then SIGKILLed after
--grace seconds, so no process (nor grandchild) is left behind.

Exit status: 0 when every worker exited 0; 1 when a worker failed or a timeout expired;
2 for bad usage, or when a worker exited 2; 128+signal when the launcher itself was
interrupted.

A worker that exits with status 2 had a configuration error (`python -m tfpar.train` exits
2 for its one-line `tfpar: error:` refusals, 1 for failures a restart may mend): the same
command would fail the same way, so the job stops at once, its last line naming the worker
and its error line, instead of spending --max_restarts on it.

A worker that fails after naming another one as not answering (a line `TFPAR_LOST_WORKER
k`: a pipeline's chief whose stage worker k froze, `tfpar.pipeline.remote.watch_stages`)
has the failure counted against worker k, so an elastic job loses k's slot.

Examples:
    python -m tfpar.launch --workers=2 --timeout=600 -- \
        python -m tfpar.train --strategy=multi_worker

Elastic: with `--min_workers=M` (< N) a worker slot that fails `--lost_after` attempts in a
row is lost for good, and the next attempt starts only the survivors (at least M; slot k keeps
`TFPAR_SLOT=k`, worker indices are renumbered), which resume from the last checkpoint on the
new world size (`tfpar.checkpoint`); `--max_restarts` defaults to enough restarts for that
((N - M + 1) x --lost_after). The launcher says which slot was lost and, when the
trainer reports the resume, at which step and how long after the loss.

A whole host lost at once (its link cut, the host gone) fails every worker in a collective,
and the first to exit is as likely on a healthy host. The attempt is counted against every
slot of that host together, so the host is lost as a unit after --lost_after such attempts
(one line naming the host and its slots), when the other hosts' workers named all of that
host's workers, and only those, as unhealthy (TensorFlow's coordination service: "stopped
sending heartbeats"), or else when the launcher's probe finds that host unreachable: after
the attempt's workers are stopped, it connects to each host's first worker ports, on every
address the host's name resolves to, all at once, within --probe_timeout s
(`tfpar.host_loss.probe_hosts`); a host that neither accepts nor refuses (no reply, no
route) while another host answers is cut off (`tfpar.host_loss.lost_host`). So a host
named only in part (TensorFlow names at most 3 stale tasks a check), or not at all (a
retried attempt failing at start-up while the host stays down), is still lost whole; a host
that refuses is up, and the attempt is counted against the worker the names point at (all
named tasks on one host: the lowest), else against the first to exit. The probe runs only
when the job could lose a host (several hosts, at least --min_workers slots on the others);
before an attempt's workers start, each host that has not yet answered is checked (its
ports closed then, so a live host's refuse; one line for a host that does not answer). A
host silent then and again after the attempt failed, while another host answers, is lost
whole (down at launch); one whose name did not resolve is not judged by the probe. A
firewall that drops connections to closed ports, or rejects them with "host prohibited",
makes a live host look cut off too: there, --probe_timeout=0 (names only).

Multi-host: `--hosts=node1:2,node2:2` puts worker slots on hosts (in that order), builds the
TF_CONFIGs over all of them and starts each worker with `--runner` (ssh by default, `local`
for tests); signals and the end of the job reach every worker as above (over ssh, through
the connection).

Growing back: with `--discovery=CMD` the launcher runs CMD (a shell command) every
`--discovery_interval` seconds; it prints the worker slots available now as HOST:SLOTS items
(comma- or line-separated, as `--hosts`). A lost slot is offered again once CMD, having
stopped listing it, lists it again (its host went away and answers again; a host that
answered the launcher's probe before its first start must answer it again, else one line
says its slots wait); slots beyond the current ones are offered whenever CMD lists them,
up to `--max_workers`. When a slot is
offered the launcher sends SIGTERM: every worker agrees on a step within a few steps, writes a
checkpoint there and stops (`tfpar.preemption`), and the next attempt starts on the larger
world from that checkpoint (no step repeated; a worker without the preemption guard is simply
restarted from its last checkpoint). Each change is said with the step and the world size.

`--log_dir` is absl's own flag, reused: when set, worker i's output also goes to
LOG_DIR/worker_<i>.log (unprefixed; appended to on restarts).

Workers started on this machine get `TMPDIR` pointed at a new directory inside the
launcher's temporary directory: TensorFlow's autograph writes a Python source there per
converted function and removes it at exit, which a killed worker (a failure, a restart, a
stop past `--grace`) never reaches. When the launch ends the launcher removes those sources,
and the directory if nothing else is left in it; any other file a worker left there stays.
"""

import contextlib
import dataclasses
import functools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags, logging

from tfpar import tf_config
from tfpar.errors import ConfigError, TfparError
from tfpar.host_loss import (LostHost, Unhealthy, cut_off_host, lost_host, named_worker,
                              probe_hosts)

READY_MARKER = "TFPAR_READY"
LOST_MARKER = "TFPAR_LOST_WORKER"  # `tfpar.pipeline.remote.LOST_MARKER`
CONFIG_EXIT = 2  # a worker's configuration error: not retried
CONFIG_ERROR = "config"  # `_run_attempt`'s kind for it
_POLL_S = 0.05

FLAGS = flags.FLAGS


def define_flags(flag_values=FLAGS):
    """Defines the launcher's flags (only `run()` calls this: importing defines none)."""
    from tfpar import flags as tfpar_flags
    if "workers" not in flag_values:
        define = dict(flag_values=flag_values)
        flags.DEFINE_integer("workers", None, "Worker processes to start (required, >= 1).",
                             lower_bound=1, **define)
        flags.DEFINE_string("host", "127.0.0.1", "Address the workers listen on; their free "
                            "ports are picked on it.", **define)
        flags.DEFINE_float("timeout", 0, "Seconds the whole launch may take (all attempts) "
                           "before every worker is stopped and it fails; 0 = no limit.",
                           lower_bound=0, **define)
        flags.DEFINE_float("start_timeout", 0, "Seconds within which every worker must print a "
                           f"line containing {READY_MARKER} (the trainer does once its strategy "
                           "is built); 0 = off.", lower_bound=0, **define)
        flags.DEFINE_float("grace", 5, "Seconds between SIGTERM and SIGKILL when stopping "
                           "workers.", lower_bound=0, **define)
        flags.DEFINE_integer("max_restarts", None, "When a worker fails (or misses "
                             "--start_timeout), stop the others and restart all on new ports, "
                             "up to this many times (default 0; with --min_workers below "
                             "--workers, (workers - min_workers + 1) x --lost_after: enough "
                             "to lose every slot it may lose, and one slot's worth more).",
                             lower_bound=0, **define)
        flags.DEFINE_integer("min_workers", None, "Elastic job: the fewest workers to go on "
                             "with. A worker that fails --lost_after attempts in a row is "
                             "lost for good, and the job restarts from the last checkpoint "
                             "without it while at least this many remain (default: "
                             "--workers, i.e. never shrink).", lower_bound=1, **define)
        flags.DEFINE_string("hosts", "", "Multi-host job: HOST:SLOTS,... (e.g. "
                            "node1:2,node2:2); worker i runs on the host of slot i, started "
                            "by --runner. Replaces --host; --workers defaults to the sum of "
                            "the slots.", **define)
        flags.DEFINE_enum("runner", "ssh", ["ssh", "local"], "How workers are started on "
                          "--hosts: ssh (ssh -tt HOST 'cd CWD && env TF_CONFIG=... CMD'; "
                          "ending the connection hangs up the remote worker) or local "
                          "(processes on this machine listening on HOST, for tests).",
                          **define)
        flags.DEFINE_string("ssh_options", "", "With --runner=ssh: options for ssh, before "
                            "the host (e.g. '-i ~/.ssh/cluster -p 2222').", **define)
        flags.DEFINE_integer("base_port", 0, "With --hosts: worker k of a host listens on "
                             "BASE_PORT+k; 0 = free ports found on this machine (only for "
                             "addresses of this machine).", lower_bound=0, **define)
        flags.DEFINE_integer("max_workers", None, "Elastic job: the most workers to grow to "
                             "when --discovery offers more slots (default: --workers).",
                             lower_bound=1, **define)
        flags.DEFINE_string("discovery", "", "Elastic job: a shell command printing the "
                            "worker slots available now (HOST:SLOTS,...), run every "
                            "--discovery_interval s; a lost slot it lists again, or a new "
                            "one, is added at the next checkpoint (see the module doc).",
                            **define)
        flags.DEFINE_float("discovery_interval", 5, "Seconds between runs of --discovery.",
                           lower_bound=0.1, **define)
        flags.DEFINE_integer("lost_after", 2, "With --min_workers: failed attempts in a row "
                             "after which a worker counts as lost.", lower_bound=1, **define)
        flags.DEFINE_float("probe_timeout", 3.5, "Elastic multi-host job: after a failed "
                           "attempt the launcher connects to each host's worker ports; a "
                           "host that neither accepts nor refuses within this many seconds "
                           "(while another host answers) is cut off, and loses all its "
                           "slots together; 0 = no probe (a host is lost as a unit only "
                           "when the others' workers name all its workers); else >= 1.5 "
                           "(Linux resends an unanswered connect after 1 s and 3 s).",
                           lower_bound=0, **define)
    tfpar_flags.declare_key_flags(["workers", "host", "timeout", "start_timeout", "grace",
                                   "max_restarts", "min_workers", "max_workers", "discovery",
                                   "discovery_interval", "lost_after", "probe_timeout",
                                   "hosts",
                                   "runner", "ssh_options", "base_port", "log_dir"],
                                  flag_values)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One start of all workers.

    Args:
        exit_codes: per worker, as `Popen.returncode` (negative: killed by that signal).
        failure: why the attempt failed, e.g. "worker 1 exited with code 3"; "" if it succeeded.
    """

    exit_codes: tuple
    failure: str
    slots: tuple = ()


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What `launch` did: the exit status for the launcher, every attempt, a one-line summary."""

    returncode: int
    attempts: tuple
    summary: str
    elastic: tuple = ()

    @property
    def restarts(self):
        return len(self.attempts) - 1


def launch(cmd, workers, host="127.0.0.1", timeout=0.0, start_timeout=0.0, grace=5.0,
           max_restarts=None, log_dir="", env=None, out=None, err=None, min_workers=None,
           lost_after=2, hosts=None, runner=None, base_port=0, max_workers=None,
           discovery="", discovery_interval=5.0, probe_timeout=3.5, probe=None):
    """Runs `workers` copies of `cmd`, each with its own TF_CONFIG, until all end.

    Args:
        cmd: the worker command, e.g. ["python", "train.py"].
        workers: how many processes to start.
        host: where the workers listen; ports are found by binding port 0 on it.
        timeout: seconds for the whole launch, restarts included; 0 = no limit.
        start_timeout: seconds within which every worker must print `READY_MARKER`; 0 = off.
        grace: seconds between SIGTERM and SIGKILL when stopping workers.
        max_restarts: restarts of all workers allowed after a failed attempt. None: 0, or
            for an elastic job (`min_workers` < `workers`) `(workers - min_workers + 1) *
            lost_after` (losing a slot takes `lost_after` failed attempts, each a restart).
        log_dir: if set, worker i's output is also written to `log_dir/worker_<i>.log`.
        env: base environment of the workers (default: this process's).
        out: where prefixed worker lines go (default sys.stdout).
        err: where the launcher's own messages go (default sys.stderr).
        min_workers: elastic job: the fewest workers to continue with (default `workers`:
            never shrink). Worker slot k (`TFPAR_SLOT`, its index in the first attempt)
            that fails `lost_after` attempts in a row is lost for good; the next attempt
            starts the survivors (renumbered 0..M-1) and they resume from the last
            checkpoint, which restores on any world size (`tfpar.checkpoint`).
        lost_after: failed attempts in a row that make a slot lost.
        hosts: multi-host job: `[(host, slots), ...]` (see `parse_hosts`); worker slot k
            runs on the k-th slot's host, started by `runner`. `workers` must equal the
            total of the slots. None: every worker on `host`, started locally.
        runner: starts one worker: `runner(host, cmd, env, **popen_kwargs) -> Popen`
            (`local_runner`, the default, or `ssh_runner`).
        base_port: with `hosts`, worker j of a host listens on `base_port + j`; 0 = free
            ports found by binding on this machine.
        max_workers: elastic job: the most workers to grow to (default `workers`).
        discovery: elastic job: a shell command printing the slots available now
            (HOST:SLOTS,...), run every `discovery_interval` s; a lost slot it lists again
            (after a run that did not list it), or a new slot, makes the job grow at the next
            checkpoint: SIGTERM, the workers agree on a step and save there
            (`tfpar.preemption`), and the next attempt starts on the larger world.
        probe_timeout: elastic multi-host job: seconds the launcher's probe of the hosts
            (`probe_hosts`) waits for answers, in all; 0 = no probe, else >= 1.5.
        probe: `probe(addresses) -> {host: True (answered), False (unreachable), None}`
            for worker addresses ("HOST:PORT") whose ports are closed: before an
            attempt's workers start, each host that has not answered one yet, and after a
            failed attempt's workers were stopped (`_HostProbe`; default
            `probe_hosts` with `probe_timeout`); tests pass a fake.

    Returns:
        A `LaunchResult`; `returncode` is 0 only if every worker of the last attempt exited 0.

    Raises:
        ConfigError: for workers < 1, an empty command, a negative or NaN time, a
            `probe_timeout` not 0 nor a finite number >= 1.5, a `discovery_interval`
            not a finite number >= 0.1, or an unusable host.
        TfparError: if the command cannot be started.
    """
    min_workers, max_workers, placement = _checked_layout(
        cmd, workers, host, hosts, min_workers, max_workers, lost_after,
        timeout=timeout, start_timeout=start_timeout, grace=grace,
        max_restarts=0 if max_restarts is None else max_restarts,
        probe_timeout=probe_timeout, discovery_interval=discovery_interval)
    max_restarts = _restarts_allowed(max_restarts, workers, min_workers, lost_after)
    runner = runner or local_runner
    if probe is None and probe_timeout:
        probe = functools.partial(probe_hosts, timeout=probe_timeout)
    out, err = out or sys.stdout, err or sys.stderr
    hosts_probe = _HostProbe(probe, err) if probe is not None else None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    deadline = time.monotonic() + timeout if timeout else None
    attempts, signalled = [], None
    job = _World(workers, min_workers, max_workers, lost_after, err)
    watch = _ElasticWatch(err)
    offers = _Offers(placement, max_workers, discovery, discovery_interval, err,
                     functools.partial(_answers, hosts_probe, base_port))
    number = restarts = 0

    def grow_due():
        job.pending[:] = offers.added(job.slots)
        return bool(job.pending)

    with _caught_signals() as received, offers, \
            _worker_tmpdir(env, runner is local_runner) as env:
        if min_workers < workers or max_workers > workers or discovery:
            # The trainer may re-choose a mesh's degrees or a pipeline's stages for a new
            # world (tfpar.relayout).
            env = {**(os.environ if env is None else env), "TFPAR_ELASTIC": "1"}
        while True:
            watch.new_attempt()
            codes, failure, kind, blamed = _run_attempt(
                list(cmd), job.slots, placement, base_port, runner, number, deadline,
                timeout, start_timeout, grace, log_dir, env, out, received, watch.on_line,
                grow_due, hosts_probe if job.can_lose_a_host(placement) else None)
            number += 1
            signalled = received[0] if received else None
            if kind == "grow":
                if all(code == 0 for code in codes) and not watch.stopped_at:
                    attempts.append(Attempt(codes, "", tuple(job.slots)))  # it had finished
                    break
                attempts.append(Attempt(codes, failure, tuple(job.slots)))
                job.grow(number, offers, watch)
                continue
            attempts.append(Attempt(codes, failure, tuple(job.slots)))
            if (not failure or kind != "retry" or restarts == max_restarts
                    or signalled):  # a signal during the stop or the probe: no restart
                break
            restarts += 1
            if job.lose(blamed, number, failure, offers, watch, restarts, max_restarts):
                continue
            _say(err, f"attempt {number - 1}: {failure}; restarting all {len(job.slots)} "
                      f"workers on new ports (restart {restarts} of {max_restarts})")
    summary = _summary(attempts, job, restarts, max_restarts)
    _say(err, summary)
    returncode = 128 + signalled if signalled else (
        (2 if kind == CONFIG_ERROR else 1) if attempts[-1].failure else 0)
    return LaunchResult(returncode, tuple(attempts), summary, tuple(job.elastic))


def _checked_layout(cmd, workers, host, hosts, min_workers, max_workers, lost_after,
                    **times):
    """`launch`'s arguments checked: `(min_workers, max_workers, placement)`, the host of
    each worker slot. Raises `ConfigError` naming the first argument that is wrong."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError("workers", workers, "must be an integer >= 1")
    if not cmd:
        raise ConfigError("command", cmd, "give the worker command after '--', e.g. "
                          "python -m tfpar.launch --workers=2 -- python train.py")
    for name, value in times.items():
        if not value >= 0:  # NaN too
            raise ConfigError(name, value, "must be a number >= 0")
    probe_timeout = times.get("probe_timeout", 0)
    if probe_timeout and not 1.5 <= probe_timeout < float("inf"):
        raise ConfigError("probe_timeout", probe_timeout, "must be 0 (no probe) or a finite "
                          "number of seconds >= 1.5 (a live host's refusal may take one "
                          "resent connect, sent after 1 s; the default is 3.5)")
    interval = times.get("discovery_interval", 5.0)
    if not 0.1 <= interval < float("inf"):
        raise ConfigError("discovery_interval", interval, "must be a finite number of "
                          "seconds >= 0.1 (the default is 5)")
    min_workers = workers if min_workers is None else min_workers
    if not 1 <= min_workers <= workers:
        raise ConfigError("min_workers", min_workers, f"must be between 1 and --workers={workers}")
    max_workers = workers if max_workers is None else max_workers
    if max_workers < workers:
        raise ConfigError("max_workers", max_workers, f"must be >= --workers={workers}")
    if lost_after < 1:
        raise ConfigError("lost_after", lost_after, "must be >= 1")
    if not hosts:
        return min_workers, max_workers, [host] * workers
    total = sum(count for _, count in hosts)
    if total != workers:
        raise ConfigError("workers", workers, f"must equal the slots of --hosts ({total})")
    return min_workers, max_workers, [h for h, count in hosts for _ in range(count)]


def _restarts_allowed(max_restarts, workers, min_workers, lost_after):
    """`--max_restarts`, its default filled in. A slot is lost after `lost_after` failed
    attempts in a row, each a restart: an elastic job whose restarts end sooner would fail
    on its first lost worker instead of shrinking (said in one line)."""
    elastic = min_workers < workers
    default = (workers - min_workers + 1) * lost_after if elastic else 0
    if max_restarts is None:
        return default
    if elastic and max_restarts < lost_after:
        # Not refused: a job may be elastic only to grow (--discovery), its restarts few.
        logging.warning("tfpar.launch: --max_restarts=%d with --min_workers=%d: a worker is "
                        "lost only after --lost_after=%d failed attempts, each a restart, so "
                        "this job cannot shrink; leave --max_restarts unset (%d) to let it",
                        max_restarts, min_workers, lost_after, default)
    return max_restarts


class _World:
    """An elastic job's worker slots across attempts: which run next (`slots`; worker i
    runs `slots[i]`), each slot's failed attempts in a row, the resizes so far."""

    def __init__(self, workers, min_workers, max_workers, lost_after, err):
        self.workers, self.min_workers, self.max_workers = workers, min_workers, max_workers
        self.lost_after = lost_after
        self.slots = list(range(workers))
        self.failed_in_a_row = dict.fromkeys(self.slots, 0)
        self.elastic = []
        self.pending = []  # the slots offered when the attempt was stopped to grow
        self.err = err

    def can_lose_a_host(self, placement):
        """Whether the next attempt runs on several hosts and could lose one of them
        whole (at least --min_workers slots left on the other hosts, as `lose` needs):
        only then is a host worth probing."""
        hosts = [placement[s] for s in self.slots]
        return len(set(hosts)) > 1 and any(
            len(self.slots) - hosts.count(h) >= self.min_workers for h in set(hosts))

    def grow(self, number, offers, watch):
        """The attempt was stopped to grow: the offered slots join the next one."""
        added = list(self.pending)
        offers.taken(added)
        self.slots = sorted(self.slots + added)
        self.failed_in_a_row.update(dict.fromkeys(added, 0))
        self.elastic.append({"attempt": number, "workers": len(self.slots)})
        at = f" at step {watch.stopped_at}" if watch.stopped_at else ""
        _say(self.err, f"attempt {number - 1}: stopped{at} to grow: worker slot(s) "
                       f"{', '.join(map(str, added))} offered again by --discovery; "
                       f"continuing with {len(self.slots)} workers (--max_workers="
                       f"{self.max_workers}) from that checkpoint")
        watch.changed(len(self.slots), "the workers stopped to grow")

    def lose(self, blamed, number, failure, offers, watch, restarts, max_restarts):
        """Counts the failed attempt against what it blamed: one slot, or a `LostHost` (every
        slot of a host cut off at once); True if that is now lost for good and the next
        attempt runs without it."""
        group = (blamed.slots if isinstance(blamed, LostHost)
                 else () if blamed is None else (blamed,))
        for slot in self.failed_in_a_row:
            self.failed_in_a_row[slot] = (self.failed_in_a_row[slot] + 1
                                          if slot in group else 0)
        if (not group or min(self.failed_in_a_row[s] for s in group) < self.lost_after
                or len(self.slots) - len(group) < self.min_workers
                or len(self.slots) <= len(group)):
            return False
        for slot in group:
            self.slots.remove(slot)
            offers.lost(slot)
        self.elastic.append({"attempt": number, "workers": len(self.slots)})
        times = min(self.failed_in_a_row[s] for s in group)
        what = (f"host {blamed.host} is lost with its worker slot(s) "
                f"{', '.join(map(str, group))}" if isinstance(blamed, LostHost)
                else f"worker slot {blamed} is lost")
        _say(self.err, f"attempt {number - 1}: {failure}; {what} (failed {times} attempts "
                       f"in a row): continuing with {len(self.slots)} workers (--min_workers="
                       f"{self.min_workers}) from the last checkpoint (restart {restarts} "
                       f"of {max_restarts})")
        watch.changed(len(self.slots), "the loss was detected")
        return True


class _HostProbe:
    """The launcher's probe of the hosts' worker ports (`probe(addresses)`, see `launch`).

    Before an attempt's workers start (`baseline`) every host not yet trusted is checked,
    its worker ports closed then, so a live host's refuse: a host that answers is trusted
    from then on. After a failed attempt (`after`) the trusted hosts are probed, and so is
    a host whose closed ports gave no reply before this attempt started: silent before the
    start and after the failure, while another host answers, it is dead (down at launch
    and still), lost as a unit. A host whose name did not resolve before the start, or
    that gave no reply before and answers nothing now, says nothing."""

    def __init__(self, probe, err):
        self.probe, self.err = probe, err
        self.trusted = set()
        self.silent = set()  # untrusted hosts whose last pre-start check had no reply
        self._said = set()

    def baseline(self, hosts, addresses):
        new = list(dict.fromkeys(h for h in hosts if h not in self.trusted))
        if not new:
            return
        answers = self.probe([a for h, a in zip(hosts, addresses) if h in new])
        for host in new:
            self.silent.discard(host)
            if answers.get(host):
                self.trusted.add(host)
                continue
            if answers.get(host) is False:
                self.silent.add(host)
            if host in self._said:
                continue
            self._said.add(host)
            why = ("no reply or no route" if answers.get(host) is False
                   else "no answer in time or its name did not resolve")
            _say(self.err, f"host {host} did not answer the launcher's probe of its closed "
                           f"worker ports before its workers started ({why}): it is checked "
                           f"again before each attempt; until it answers, it is lost as a "
                           f"unit only if it gives no reply after a failed attempt too "
                           f"while another host answers, or when the other hosts' workers "
                           f"name all its workers")

    def after(self, hosts, addresses):
        """`{host: answer}` for `hosts`: the probe's for the trusted hosts and for those
        silent before this attempt started (see the class), else None; no probe at all
        when fewer than 2 hosts are such (one host's answer cannot tell a lost host)."""
        asked = {h for h in hosts if h in self.trusted or h in self.silent}
        if len(asked) < 2:
            return dict.fromkeys(hosts)
        answers = self.probe([a for h, a in zip(hosts, addresses) if h in asked])
        self.trusted.update(h for h in asked if answers.get(h))  # a refusal: up
        self.silent -= self.trusted
        return {h: answers.get(h) if h in asked else None for h in hosts}


def _summary(attempts, job, restarts, max_restarts):
    """The launcher's last line: how the job ended, its attempts and world sizes."""
    failure = attempts[-1].failure
    summary = (f"failed: {failure}" if failure
               else f"all {len(job.slots)} workers exited 0")
    if max_restarts or job.elastic:
        plural = "" if restarts == 1 else "s"
        summary += f" ({len(attempts)} attempt(s), {restarts} restart{plural})"
    if job.elastic:
        sizes = " -> ".join(str(n) for n in [job.workers] +
                            [e["workers"] for e in job.elastic])
        summary += f"; world size {sizes}"
    return summary


AUTOGRAPH_PREFIX = "__autograph_generated_file"  # the files TensorFlow's autograph loader writes


@contextlib.contextmanager
def _worker_tmpdir(env, local):
    """The workers' environment (`env`, None: this process's) with `TMPDIR` a new directory
    inside its temporary directory (only for workers on this machine, `local`); on exit,
    the autograph sources killed workers left there are removed, and the directory if then
    empty. Yields `env` unchanged when not local or when the directory cannot be made."""
    if not local:
        yield env
        return
    base = dict(os.environ if env is None else env)
    try:
        path = tempfile.mkdtemp(prefix="tfpar-launch-",
                                dir=base.get("TMPDIR") or tempfile.gettempdir())
    except OSError as e:
        logging.info("workers keep TMPDIR as it is (no directory for them: %s)", e)
        yield env
        return
    try:
        yield {**base, "TMPDIR": path}
    finally:
        _remove_autograph_sources(path)


def _remove_autograph_sources(path):
    """Removes autograph's sources (and their bytecode) from `path`, then `path` if empty."""
    for folder in (os.path.join(path, "__pycache__"), path):
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                if name.startswith(AUTOGRAPH_PREFIX):
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(folder, name))
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only if empty: a worker's own files stay


def free_ports(count, host="127.0.0.1"):
    """`count` distinct free TCP ports on `host`.

    All sockets stay bound until all ports are known, so the kernel cannot hand out one
    port twice. (Another program may still take one before a worker binds it; a failed
    worker is what --max_restarts is for.)

    Raises:
        ConfigError: if `host` cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = []
    try:
        for _ in range(count):
            sockets.append(socket.socket(family, socket.SOCK_STREAM))
            sockets[-1].bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    except OSError as e:
        raise ConfigError("host", host, f"cannot bind a port on it ({e}); use a local "
                          "address such as 127.0.0.1") from None
    finally:
        for s in sockets:
            s.close()


def parse_hosts(text):
    """`"node1:2,node2:2"` → `[("node1", 2), ("node2", 2)]` (IPv6 as `[::1]:2`).

    Raises:
        ConfigError: an item is not HOST:SLOTS with SLOTS >= 1, or a host repeats.
    """
    hosts = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, _, count = item.rpartition(":")
        if not name or not count.isdigit() or int(count) < 1:
            raise ConfigError("hosts", text, "use comma-separated HOST:SLOTS items with "
                              "SLOTS >= 1, e.g. node1:2,node2:2")
        hosts.append((name.strip("[]"), int(count)))
    if not hosts:
        raise ConfigError("hosts", text, "name at least one HOST:SLOTS, e.g. node1:2")
    names = [h for h, _ in hosts]
    if len(set(names)) != len(names):
        raise ConfigError("hosts", text, "name each host once, with all its slots")
    return hosts


def local_runner(host, cmd, env, **popen_kwargs):
    """Starts a worker on this machine (it listens on `host`, a local address)."""
    return subprocess.Popen(cmd, env=env, **popen_kwargs)


_FORWARDED = ("TF_CONFIG", "TFPAR_", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL",
              "TF_ENABLE_ONEDNN_OPTS")  # --cpu_kernels=auto: yours wins on every host


def ssh_command(host, cmd, env, cwd=None, options=()):
    """The `ssh` command line that runs `cmd` on `host` in `cwd` (default this directory)
    with the launcher's variables of `env` (TF_CONFIG, TFPAR_*); `options` go to ssh before
    the host (e.g. `-i KEY -p PORT`). `-tt` gives the remote worker a terminal, so closing
    the connection (the launcher ending the local ssh) hangs it up."""
    pairs = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())
             if k.startswith(_FORWARDED)]
    remote = (f"cd {shlex.quote(cwd or os.getcwd())} && exec env {' '.join(pairs)} "
              + " ".join(shlex.quote(c) for c in cmd))
    return ["ssh", "-tt", "-o", "BatchMode=yes", *options, host, remote]


def ssh_runner(host, cmd, env, options=(), **popen_kwargs):
    """Starts a worker on `host` over ssh (see `ssh_command`)."""
    return subprocess.Popen(ssh_command(host, cmd, env, options=options), env=env,
                            **popen_kwargs)


def _addresses(hosts, base_port):
    """One listening address per worker: BASE_PORT+j for the j-th worker of a host, or free
    ports (all found before any worker starts)."""
    ports, seen = [], {}
    for h in hosts:
        seen[h] = seen.get(h, 0) + 1
        ports.append(base_port + seen[h] - 1 if base_port else None)
    if not base_port:
        found = {h: iter(free_ports(n, h)) for h, n in seen.items()}
        ports = [next(found[h]) for h in hosts]
    return [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in zip(hosts, ports)]


def _run_attempt(cmd, slots, placement, base_port, runner, number, deadline, timeout,
                 start_timeout, grace, log_dir, env, out, received, on_line=None,
                 grow_due=None, probe=None):
    """Starts all workers, watches them, stops them. Returns (exit codes, failure, kind, the
    slot of the worker that failed, a `LostHost` or None); `probe` (a `_HostProbe`), if
    given, probes new hosts before the workers start and, when a failure's names do not
    settle whether a host was lost whole, the hosts after the workers were stopped; kind
    is "retry" (a worker failed: restarting may help), `CONFIG_ERROR` (a worker exited
    `CONFIG_EXIT`: its error line is in the failure), "grow" (stopped because `grow_due()`
    offered slots) or "" (done, or a failure a restart cannot mend)."""
    workers = len(slots)
    hosts = [placement[s].strip("[]") for s in slots]
    addresses = _addresses(hosts, base_port)
    if probe is not None:
        probe.baseline(hosts, addresses)
        if received:  # a signal during the check: no worker started
            return ((), f"the launcher received {signal.Signals(received[0]).name} before "
                        f"the workers started", "", None)
    ready = [False] * workers
    lock = threading.Lock()
    procs, pumps = [], []
    error_lines = [""] * workers  # each worker's last `tfpar: error:` line
    named = [None] * workers  # the worker each one named as not answering (LOST_MARKER)
    unhealthy = [Unhealthy() for _ in range(workers)]  # the tasks each one named so

    def watch_line(index, line):
        if "tfpar: error:" in line:
            error_lines[index] = line[line.index("tfpar: error:"):].strip()
        unhealthy[index].read(line)
        if line.startswith(LOST_MARKER):
            with contextlib.suppress(ValueError):
                named[index] = int(line.split()[1])
        if on_line is not None:
            on_line(index, line)

    try:
        for i in range(workers):
            worker_env = dict(os.environ if env is None else env)
            worker_env.update(TF_CONFIG=tf_config.make(addresses, i), TFPAR_WORKER_INDEX=str(i),
                              TFPAR_NUM_WORKERS=str(workers), TFPAR_RESTART=str(number),
                              TFPAR_SLOT=str(slots[i]))
            # Python workers writing to a pipe block-buffer; unbuffered output appears live.
            worker_env.setdefault("PYTHONUNBUFFERED", "1")
            log = (open(os.path.join(log_dir, f"worker_{slots[i]}.log"), "a" if number else "w")
                   if log_dir else None)
            try:
                proc = runner(hosts[i], cmd, worker_env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
            except OSError as e:
                if log:
                    log.close()
                raise TfparError(f"cannot start the worker command {cmd[0]!r}: {e}") from None
            procs.append(proc)
            logging.info("worker %d: pid %d, address %s", i, proc.pid, addresses[i])
            pumps.append(threading.Thread(
                target=_pump,
                args=(proc.stdout, f"[worker {i}] ", out, log, lock, ready, i, watch_line),
                daemon=True))
            pumps[-1].start()
        failure, kind, failed = _watch(procs, ready, deadline, timeout, start_timeout,
                                       received, grow_due)
    finally:
        # Forward the launcher's own signal (SIGINT stays SIGINT); otherwise SIGTERM.
        _stop(procs, received[0] if received else signal.SIGTERM, grace)
        for pump in pumps:
            pump.join(timeout=5)  # the group is dead; only an escaped daemon could hold the pipe
    codes = tuple(p.returncode for p in procs)
    first, marked = failed, False
    if failed is not None and codes[failed] > 0 and named[failed] in range(workers):
        # A pipeline's chief gave up on a stage worker that stopped answering (frozen, its
        # host hung or cut off: `tfpar.pipeline.remote.watch_stages`): that worker is lost.
        failure += f"; it named worker {named[failed]}, which stopped answering"
        failed, marked = named[failed], True
    if kind == "retry" and codes[first] == CONFIG_EXIT:
        return codes, failure + (
            f", a configuration error a restart would repeat (not retried): "
            f"{error_lines[first] or 'it printed no tfpar: error: line'}"
        ), CONFIG_ERROR, slots[failed]
    if kind == "retry":
        # `stale`, not `named`: the pumps' `watch_line` may still write to `named`.
        stale = [u.tasks & set(range(workers)) for u in unhealthy]
        more, failed = _host_or_worker(hosts, addresses, stale, failed,
                                       None if received else probe, by_names=not marked)
        failure += more
    if isinstance(failed, LostHost):
        return codes, failure, kind, LostHost(failed.host, tuple(slots[i] for i in failed.slots))
    return codes, failure, kind, slots[failed] if failed is not None else None


def _host_or_worker(hosts, addresses, stale, failed, probe, by_names=True):
    """What a failed attempt is counted against when no worker named another as not
    answering: `(more words for the failure, a LostHost of worker indices or a worker
    index)`. A host cut off (a link cut, the host gone) fails every worker in a collective,
    the first to exit (`failed`) as likely on a healthy host: the other hosts' workers
    naming all of a host's workers settle it, else the probe does, if any (`stale`: the
    tasks each worker named as unhealthy; `tfpar.host_loss.lost_host`). No host lost
    whole: the task the names point at (`named_worker`; with `by_names`), else `failed`."""
    answers = None
    if probe is not None and cut_off_host(hosts, stale) is None:
        answers = probe.after(hosts, addresses)
    cut_off, evidence = lost_host(hosts, stale, answers)
    if cut_off is not None:
        members = tuple(i for i, h in enumerate(hosts) if h == cut_off)
        if evidence == "named":
            return (f"; the other hosts' workers named every worker of host {cut_off} "
                    f"({', '.join(map(str, members))}) as unhealthy",
                    LostHost(cut_off, members))
        others = [h for h in dict.fromkeys(hosts) if answers.get(h)]
        return (f"; host {cut_off} did not answer the launcher's probe of its workers' "
                f"ports (no route or no reply), host(s) {', '.join(others)} did",
                LostHost(cut_off, members))
    worker = named_worker(hosts, stale) if by_names else None
    if worker is None:
        return "", failed
    up = (f", host {hosts[worker]} answered the launcher's probe"
          if answers and answers.get(hosts[worker]) else "")
    return (f"; worker {worker} was named as unhealthy{up}: a lost worker, not a lost "
            f"host", worker)


def _watch(procs, ready, deadline, timeout, start_timeout, received, grow_due=None):
    """Polls until every worker exited 0 or something failed. Returns (failure, kind, the
    index of the worker that failed or None); kind as `_run_attempt`'s."""
    started = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, code in enumerate(codes) if code]
        if failed:
            # A worker killed by a signal is the cause; the others' errors are its echo.
            i = min(failed, key=lambda k: (codes[k] > 0, k))
            return f"worker {i} {_describe(codes[i])}", "retry", i
        if all(code == 0 for code in codes):
            return "", "", None
        if received:
            return f"the launcher received {signal.Signals(received[0]).name}", "", None
        if grow_due is not None and grow_due():
            return "stopped to grow", "grow", None
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return f"--timeout={timeout:g}s expired before the workers finished", "", None
        if start_timeout and now - started >= start_timeout:
            late = [i for i, code in enumerate(codes) if code is None and not ready[i]]
            if late:
                return (f"--start_timeout={start_timeout:g}s expired: worker(s) "
                        f"{', '.join(map(str, late))} never printed {READY_MARKER}",
                        "retry", late[0])
        time.sleep(_POLL_S)


def _stop(procs, sig, grace):
    """Sends `sig` to every worker's process group, waits up to `grace` s, then SIGKILLs them.

    Groups are signalled even when the worker itself has exited: its children may live on.
    """
    for proc in procs:
        _killpg(proc, sig)
    end = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(_POLL_S)
    for proc in procs:
        _killpg(proc, signal.SIGKILL)
        proc.wait()


def _killpg(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone already


def _pump(stream, prefix, out, log, lock, ready, index, on_line=None):
    """Copies one worker's merged stdout/stderr line by line, prefixed, as it arrives."""
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            line += "" if line.endswith("\n") else "\n"
            if READY_MARKER in line:
                ready[index] = True
            if on_line is not None:
                on_line(index, line)
            with lock:  # whole lines: workers' output must not interleave mid-line
                try:
                    out.write(prefix + line)
                    out.flush()
                except (OSError, ValueError):
                    pass  # launcher output closed: keep draining so the worker never blocks
            if log:
                log.write(line)
                log.flush()
    if log:
        log.close()


class _ElasticWatch:
    """Times each change of world size: from the loss of a worker being declared (or capacity
    returning) to the line the trainer prints when it resumes on the new world size
    (`tfpar.checkpoint`: "world size changed at step S"), and says both with the step. Also
    notes the step at which the workers stopped on SIGTERM (`tfpar.preemption`)."""

    _RESUMED = re.compile(r"world size changed at step (\d+)")
    _STOPPED = re.compile(r"tfpar: stopping at step (\d+) on SIGTERM")

    def __init__(self, err):
        self._err, self._since, self._workers, self._cause = err, None, None, ""
        self.resumes = []  # (step, workers, seconds)
        self.stopped_at = None

    def new_attempt(self):
        self.stopped_at = None

    def changed(self, workers, cause):
        self._since, self._workers, self._cause = time.monotonic(), workers, cause

    def on_line(self, index, line):
        stopped = self._STOPPED.search(line)
        if stopped:
            self.stopped_at = int(stopped.group(1))
        if self._since is None:
            return
        match = self._RESUMED.search(line)
        if match:
            seconds = time.monotonic() - self._since
            self._since = None
            self.resumes.append((int(match.group(1)), self._workers, seconds))
            _say(self._err, f"training resumed at step {match.group(1)} on {self._workers} "
                            f"workers, {seconds:.1f} s after {self._cause}")


class _Offers:
    """Runs the `--discovery` command every `interval` s in a thread and says which worker
    slots it offers that the job is not using.

    A slot is offered when the command lists its host with enough slots (slot k is the j-th
    slot of its host in `placement`); a slot lost earlier only after one run of the command
    did not list it (so a host that stays listed while its worker keeps failing is not taken
    back at once); no slot of a host, lost or new, while that host, listed with a slot to
    offer, does not answer the launcher's probe (`update`). Hosts or slots not in `placement` are appended to it, up to
    `max_workers` in all.
    """

    def __init__(self, placement, max_workers, command, interval, err, reachable=None):
        self.placement, self.max_workers = placement, max_workers
        self.command, self.interval, self._err = command, interval, err
        self.reachable = reachable  # (host, rank) -> True, False, None: `_answers`
        self._lost, self._cleared, self._said = set(), set(), set()
        self._held = set()  # hosts whose slots are not offered: silent to the probe
        self._listed = None  # {host: slots} of the newest run, None before the first
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = None

    def __enter__(self):
        if self.command:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def lost(self, slot):
        with self._lock:
            self._lost.add(slot)
            self._cleared.discard(slot)

    def added(self, running):
        """Slots to add to `running` now (empty when nothing is offered)."""
        with self._lock:
            listed = self._listed
            if listed is None or len(running) >= self.max_workers:
                return []
            for h, n in listed.items():  # new slots a listed host has beyond the placement
                while (self.placement.count(h) < n
                       and len(self.placement) < self.max_workers + len(self._lost)):
                    self.placement.append(h)
            offered = []
            for k, h in enumerate(self.placement):
                rank = self.placement[:k].count(h)
                if (k not in running and rank < listed.get(h, 0) and h not in self._held
                        and (k not in self._lost or k in self._cleared)):
                    offered.append(k)
            offered = offered[:self.max_workers - len(running)]
            return offered

    def taken(self, slots):
        with self._lock:
            self._lost.difference_update(slots)
            self._cleared.difference_update(slots)

    def _loop(self):
        while not self._stop.is_set():
            listed = self._run()
            if listed is not None:
                self.update(listed)
            self._stop.wait(self.interval)

    def update(self, listed):
        """Takes one run's listing (`{host: slots}`). A host listed with a slot to offer (a
        lost slot listed again, or more slots than the placement holds) is asked whether
        it answers the launcher's probe (`reachable`) before the listing is published, and
        all its slots are held back while it does not, so none is offered unprobed."""
        with self._lock:
            back = {k: self.placement[k] for k in self._lost & self._cleared
                    if self.placement[:k].count(self.placement[k])
                    < listed.get(self.placement[k], 0)}
            ask = {h: self.placement.count(h) for h, n in listed.items()
                   if self.placement.count(h) < n}  # new slots: the first one's rank
            for k, h in back.items():
                rank = self.placement[:k].count(h)
                ask[h] = min(ask.get(h, rank), rank)
        held = set()
        for host in sorted(ask):
            if self.reachable is not None and self.reachable(host, ask[host]) is False:
                held.add(host)
                if host not in self._said:
                    lost = ", ".join(str(k) for k in sorted(back) if back[k] == host)
                    what = (f"lists host {host} again, but it did not answer the "
                            f"launcher's probe: its lost slot(s) {lost}" if lost else
                            f"lists more slots on host {host}, but it did not answer the "
                            f"launcher's probe: its slots")
                    _say(self._err, f"--discovery {what} are not offered until it does")
                self._said.add(host)
            else:
                self._said.discard(host)
        with self._lock:
            self._listed, self._held = listed, held
            for k in self._lost:
                h = self.placement[k]
                if self.placement[:k].count(h) >= listed.get(h, 0):
                    self._cleared.add(k)

    def _run(self):
        try:
            proc = subprocess.run(self.command, shell=True, capture_output=True, text=True,
                                  timeout=max(30.0, self.interval))
            if proc.returncode:
                raise OSError(f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}")
            text = ",".join(proc.stdout.split())
            return {h.strip("[]"): n for h, n in parse_hosts(text)} if text else {}
        except (OSError, subprocess.TimeoutExpired, ConfigError) as e:
            _say(self._err, f"--discovery={self.command!r} failed ({e}); offers unchanged")
            return None


def _answers(hosts_probe, base_port, host, rank):
    """Whether `host` answers the launcher's probe now, on the port its worker of `rank`
    would listen on (a free port of this machine without `base_port`): True, False (no
    reply, no route) or None (no probe, or the host never answered one: no evidence)."""
    if hosts_probe is None or host not in hosts_probe.trusted:
        return None
    try:
        port = base_port + rank if base_port else free_ports(1, host)[0]
    except ConfigError:
        return None
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return hosts_probe.probe([address]).get(host)


def _describe(code):
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@contextlib.contextmanager
def _caught_signals():
    """Records SIGINT/SIGTERM sent to the launcher (in a list) so the watch loop can stop the
    workers instead of the launcher dying and orphaning them."""
    received, previous = [], {}
    if threading.current_thread() is threading.main_thread():  # handlers only go there
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(stream, message):
    print(f"tfpar.launch: {message}", file=stream, flush=True)


def _usage_error(message):
    print(f"tfpar.launch: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _parse_argv(argv):
    """Parses the launcher's flags (before `--`); returns the worker command (after it)."""
    split = argv.index("--") if "--" in argv else len(argv)
    own, cmd = argv[:split], argv[split + 1:]
    try:
        extra = FLAGS(own)[1:]
    except flags.Error as e:
        _usage_error(str(e))
    if FLAGS.workers is None and not FLAGS.hosts:
        _usage_error("--workers (or --hosts) is required, e.g. --workers=2")
    if extra:
        _usage_error(f"unexpected argument(s) {' '.join(extra)!r} before '--'; usage: "
                     "python -m tfpar.launch --workers=N [flags] -- CMD...")
    if not cmd:
        _usage_error("no worker command; usage: "
                     "python -m tfpar.launch --workers=N [flags] -- CMD...")
    return cmd


def main(cmd):
    try:
        hosts = parse_hosts(FLAGS.hosts) if FLAGS.hosts else None
        workers = FLAGS.workers or sum(n for _, n in hosts)
        runner = local_runner
        if hosts and FLAGS.runner == "ssh":
            runner = functools.partial(ssh_runner, options=shlex.split(FLAGS.ssh_options))
        result = launch(cmd, workers, host=FLAGS.host, timeout=FLAGS.timeout,
                        start_timeout=FLAGS.start_timeout, grace=FLAGS.grace,
                        max_restarts=FLAGS.max_restarts, log_dir=FLAGS.log_dir,
                        min_workers=FLAGS.min_workers, lost_after=FLAGS.lost_after,
                        hosts=hosts, runner=runner, base_port=FLAGS.base_port,
                        max_workers=FLAGS.max_workers, discovery=FLAGS.discovery,
                        discovery_interval=FLAGS.discovery_interval,
                        probe_timeout=FLAGS.probe_timeout)
    except TfparError as e:
        _usage_error(str(e))
    return result.returncode


def run():
    """`tfpar-launch` / `python -m tfpar.launch`."""
    define_flags()
    app.run(main, flags_parser=_parse_argv)


if __name__ == "__main__":
    run()
