"""`TF_CONFIG` checked before TensorFlow reads it.

TensorFlow accepts a malformed `TF_CONFIG` silently or fails deep inside a collective with
a message that names neither the field nor the fix. `parse` checks every field first and
raises one `ConfigError` naming it. Pure Python: importing this never imports TensorFlow.

Examples:
    >>> info = parse(make(["localhost:12345", "localhost:23456"], 1))
    >>> info.worker_index, info.num_workers, info.is_chief, info.own_address
    (1, 2, False, 'localhost:23456')
"""

import dataclasses
import json
import os
import re

from tfpar import compat
from tfpar.errors import ConfigError

JOBS = ("chief", "worker", "ps", "evaluator")
_EXAMPLE = ('{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, '
            '"task": {"type": "worker", "index": 0}}')
# host:port, or [ipv6]:port; the port range is checked separately to name it in the error.
_ADDRESS_RE = re.compile(r"^(?:\[[0-9A-Fa-f:.%\w]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """A validated `TF_CONFIG`: the cluster and this process's task in it.

    Args:
        cluster: job name -> list of "host:port" addresses.
        task_type: this process's job ("chief", "worker" or "evaluator").
        task_index: this process's position in its job.
    """

    cluster: dict
    task_type: str
    task_index: int

    @property
    def num_workers(self):
        """Training processes: chief plus workers (evaluators do not train)."""
        return len(self.cluster.get("chief", [])) + len(self.cluster.get("worker", []))

    @property
    def worker_index(self):
        """Global index among training processes, chief first (as TensorFlow numbers them);
        None for an evaluator."""
        if self.task_type == "chief":
            return 0
        if self.task_type == "worker":
            return len(self.cluster.get("chief", [])) + self.task_index
        return None

    @property
    def is_chief(self):
        """True for the chief, or for worker 0 when the cluster has no chief."""
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def addresses(self):
        """Every address in the cluster, in job order chief, worker, evaluator."""
        return [a for job in JOBS for a in self.cluster.get(job, [])]

    @property
    def own_address(self):
        return self.cluster[self.task_type][self.task_index]

    @property
    def hosts(self):
        """The training processes grouped by host, in order of first appearance: a list of
        lists of `worker_index`es. Two processes share a host when their addresses name the
        same host (the text before the port, as written: `localhost` and `127.0.0.1` are
        two hosts)."""
        grouped = {}
        for index, address in enumerate(self.cluster.get("chief", [])
                                        + self.cluster.get("worker", [])):
            grouped.setdefault(address.rsplit(":", 1)[0], []).append(index)
        return list(grouped.values())


def load(environ=os.environ):
    """Reads and validates `TF_CONFIG` from `environ`; None if unset or empty.

    Raises:
        ConfigError: naming the first bad field.
    """
    return parse(environ.get("TF_CONFIG"))


def parse(raw):
    """Validates a `TF_CONFIG` JSON string.

    Args:
        raw: the JSON text, or None.

    Returns:
        A `ClusterInfo`, or None when `raw` is None or blank (no cluster: single worker).

    Raises:
        ConfigError: naming the first bad field, its value and what would work.
    """
    if raw is None or not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError("TF_CONFIG", _short(raw),
                          f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                          f"expected e.g. {_EXAMPLE}") from None
    if not isinstance(data, dict):
        raise ConfigError("TF_CONFIG", _short(raw), f"must be a JSON object like {_EXAMPLE}")
    cluster = _check_cluster(data)
    task_type, task_index = _check_task(data, cluster)
    return ClusterInfo(cluster, task_type, task_index)


def check_strategy(strategy, cluster):
    """Refuses a `--strategy` the parsed `TF_CONFIG` (`cluster`, or None) contradicts:
    `multi_worker` without a cluster, `one_device` or `mirrored` with several workers
    (rows of `tfpar.compat`'s table).

    Raises:
        ConfigError: naming `strategy` and what would work.
    """
    for rule in (compat.STRATEGY_WITHOUT_CLUSTER, compat.STRATEGY_ON_WORKERS):
        compat.enforce(rule, compat.view(strategy=strategy), cluster)


def make(addresses, index):
    """The `TF_CONFIG` JSON for worker `index` of a worker-only cluster.

    Args:
        addresses: "host:port" of every worker, in worker order.
        index: this worker's position in `addresses`.

    Raises:
        ConfigError: if the result would not pass `parse` (bad address, index out of range).
    """
    raw = json.dumps({"cluster": {"worker": list(addresses)},
                      "task": {"type": "worker", "index": index}})
    parse(raw)
    return raw


def _check_cluster(data):
    if "cluster" not in data:
        raise ConfigError("TF_CONFIG.cluster", None, f"missing; expected e.g. {_EXAMPLE}")
    cluster = data["cluster"]
    if not isinstance(cluster, dict):
        raise ConfigError("TF_CONFIG.cluster", cluster,
                          'must be an object mapping job name to a list of "host:port"')
    if not cluster:
        raise ConfigError("TF_CONFIG.cluster", cluster,
                          'is empty; list at least one worker, e.g. '
                          '{"worker": ["localhost:12345"]}')
    seen = {}  # address -> where it first appeared, to name both positions of a duplicate
    for job, addresses in cluster.items():
        setting = f"TF_CONFIG.cluster.{job}"
        if job == "ps":
            raise ConfigError(setting, addresses,
                              "parameter servers (ParameterServerStrategy) are not supported; "
                              "tfpar's multi_worker strategy uses only 'chief' and 'worker' jobs")
        if job not in JOBS:
            raise ConfigError(setting, addresses,
                              f"unknown job name {job!r}; use chief, worker or evaluator")
        if not isinstance(addresses, list) or not addresses:
            raise ConfigError(setting, addresses, 'must be a non-empty list of "host:port" strings')
        for i, address in enumerate(addresses):
            where = f"{setting}[{i}]"
            _check_address(where, address)
            if address in seen:
                raise ConfigError(where, address,
                                  f"same address as {seen[address]}; every task needs its own "
                                  "host:port")
            seen[address] = where
    if len(cluster.get("chief", [])) > 1:
        raise ConfigError("TF_CONFIG.cluster.chief", cluster["chief"],
                          "at most one chief; list the others under 'worker'")
    if not cluster.get("chief") and not cluster.get("worker"):
        raise ConfigError("TF_CONFIG.cluster", cluster,
                          "has no 'chief' or 'worker' job; training needs at least one")
    return cluster


def _check_address(setting, address):
    match = _ADDRESS_RE.match(address) if isinstance(address, str) else None
    if not match or not 1 <= int(match.group(1)) <= 65535:
        raise ConfigError(setting, address,
                          'must be "host:port" with port 1..65535, e.g. "localhost:12345" or '
                          '"[::1]:12345"')


def _check_task(data, cluster):
    jobs = ", ".join(cluster)
    if "task" not in data:
        raise ConfigError("TF_CONFIG.task", None,
                          f'missing; add e.g. "task": {{"type": "worker", "index": 0}} '
                          f"(jobs in the cluster: {jobs})")
    task = data["task"]
    if not isinstance(task, dict):
        raise ConfigError("TF_CONFIG.task", task,
                          'must be an object like {"type": "worker", "index": 0}')
    task_type = task.get("type")
    if task_type is None:
        raise ConfigError("TF_CONFIG.task.type", None,
                          f"missing; use one of the cluster's jobs: {jobs}")
    if task_type == "ps":
        raise ConfigError("TF_CONFIG.task.type", task_type,
                          "parameter servers (ParameterServerStrategy) are not supported; "
                          "use 'chief' or 'worker'")
    if task_type not in JOBS:
        raise ConfigError("TF_CONFIG.task.type", task_type,
                          "choose one of chief, worker, evaluator")
    if task_type not in cluster:
        raise ConfigError("TF_CONFIG.task.type", task_type,
                          f"TF_CONFIG.cluster has no {task_type!r} job; jobs: {jobs}")
    count = len(cluster[task_type])
    valid = f"must be an integer in 0..{count - 1} (the {task_type!r} job has {count} task(s))"
    if "index" not in task:
        raise ConfigError("TF_CONFIG.task.index", None, f"missing; {valid}")
    index = task["index"]
    # bool is an int in Python; true/false in JSON is a mistake, not an index.
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ConfigError("TF_CONFIG.task.index", index, valid)
    return task_type, index


def _short(text, limit=120):
    return text if len(text) <= limit else text[:limit] + "..."
