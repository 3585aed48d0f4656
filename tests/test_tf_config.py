"""TF_CONFIG is checked field by field before TensorFlow sees it."""

import json

import pytest
from hypothesis import given, strategies as st

from tfpar import tf_config
from tfpar.errors import ConfigError
from subproc import run_python

W2 = ["localhost:1111", "localhost:2222"]


def cfg(cluster=None, task=None, **top):
    data = dict(top)
    if cluster is not None:
        data["cluster"] = cluster
    if task is not None:
        data["task"] = task
    return json.dumps(data)


# (TF_CONFIG text, the setting the error must name, words the explanation must contain)
FAULTS = [
    ('{"cluster": {"worker": ["a:1"]},\n "task": }', "TF_CONFIG", "line 2 column"),
    ('["a:1"]', "TF_CONFIG", "JSON object"),
    (cfg(task={"type": "worker", "index": 0}), "TF_CONFIG.cluster", "missing"),
    (cfg(["a:1"], {"type": "worker", "index": 0}), "TF_CONFIG.cluster", "job name"),
    (cfg({}, {"type": "worker", "index": 0}), "TF_CONFIG.cluster", "empty"),
    (cfg({"worker": "a:1"}, {"type": "worker", "index": 0}), "TF_CONFIG.cluster.worker", "list"),
    (cfg({"worker": []}, {"type": "worker", "index": 0}), "TF_CONFIG.cluster.worker", "non-empty"),
    (cfg({"worker": [1234]}, {"type": "worker", "index": 0}), "TF_CONFIG.cluster.worker[0]",
     "host:port"),
    (cfg({"trainer": ["a:1"]}, {"type": "trainer", "index": 0}), "TF_CONFIG.cluster.trainer",
     "unknown job"),
    (cfg({"worker": ["a:1"], "ps": ["b:2"]}, {"type": "worker", "index": 0}),
     "TF_CONFIG.cluster.ps", "ParameterServerStrategy"),
    (cfg({"evaluator": ["a:1"]}, {"type": "evaluator", "index": 0}), "TF_CONFIG.cluster",
     "'chief' or 'worker'"),
    (cfg({"worker": W2}), "TF_CONFIG.task", "missing"),
    (cfg({"worker": W2}, ["worker", 0]), "TF_CONFIG.task", "object"),
    (cfg({"worker": W2}, {"index": 0}), "TF_CONFIG.task.type", "missing"),
    (cfg({"worker": W2}, {"type": "master", "index": 0}), "TF_CONFIG.task.type", "chief, worker"),
    (cfg({"worker": W2}, {"type": "ps", "index": 0}), "TF_CONFIG.task.type",
     "ParameterServerStrategy"),
    (cfg({"worker": W2}, {"type": "chief", "index": 0}), "TF_CONFIG.task.type", "no 'chief' job"),
    (cfg({"worker": W2}, {"type": "worker"}), "TF_CONFIG.task.index", "0..1"),
    (cfg({"worker": W2}, {"type": "worker", "index": "1"}), "TF_CONFIG.task.index", "integer"),
    (cfg({"worker": W2}, {"type": "worker", "index": True}), "TF_CONFIG.task.index", "integer"),
    (cfg({"worker": W2}, {"type": "worker", "index": -1}), "TF_CONFIG.task.index", "0..1"),
    (cfg({"worker": W2}, {"type": "worker", "index": 2}), "TF_CONFIG.task.index", "0..1"),
    (cfg({"worker": ["localhost"]}, {"type": "worker", "index": 0}),
     "TF_CONFIG.cluster.worker[0]", "port 1..65535"),
    (cfg({"worker": ["localhost:0"]}, {"type": "worker", "index": 0}),
     "TF_CONFIG.cluster.worker[0]", "port 1..65535"),
    (cfg({"worker": ["localhost:65536"]}, {"type": "worker", "index": 0}),
     "TF_CONFIG.cluster.worker[0]", "port 1..65535"),
    (cfg({"worker": ["a:1", "host name:80"]}, {"type": "worker", "index": 0}),
     "TF_CONFIG.cluster.worker[1]", "host:port"),
    (cfg({"worker": ["::1:80"]}, {"type": "worker", "index": 0}),
     "TF_CONFIG.cluster.worker[0]", "[::1]"),
    (cfg({"chief": ["a:1"], "worker": ["b:2", "a:1"]}, {"type": "worker", "index": 0}),
     "TF_CONFIG.cluster.worker[1]", "TF_CONFIG.cluster.chief[0]"),
    (cfg({"chief": ["a:1", "b:2"]}, {"type": "chief", "index": 0}), "TF_CONFIG.cluster.chief",
     "at most one chief"),
]


@pytest.mark.parametrize("raw,setting,hint", FAULTS)
def test_each_fault_is_one_error_naming_the_field(raw, setting, hint):
    with pytest.raises(ConfigError) as info:
        tf_config.parse(raw)
    assert info.value.setting == setting
    message = str(info.value)
    assert message.startswith(f"{setting}=")
    assert hint in message


def test_no_config_means_no_cluster():
    assert tf_config.parse(None) is None
    assert tf_config.parse("  ") is None
    assert tf_config.load({}) is None


def test_worker_only_cluster():
    info = tf_config.parse(cfg({"worker": W2 + ["[::1]:3333"]}, {"type": "worker", "index": 2}))
    assert (info.num_workers, info.worker_index, info.is_chief) == (3, 2, False)
    assert info.own_address == "[::1]:3333"
    assert tf_config.parse(cfg({"worker": W2}, {"type": "worker", "index": 0})).is_chief


def test_chief_comes_first_and_is_the_only_chief():
    cluster = {"chief": ["c:1"], "worker": W2, "evaluator": ["e:9"]}
    chief = tf_config.parse(cfg(cluster, {"type": "chief", "index": 0}))
    worker0 = tf_config.parse(cfg(cluster, {"type": "worker", "index": 0}))
    evaluator = tf_config.parse(cfg(cluster, {"type": "evaluator", "index": 0}))
    assert (chief.worker_index, chief.is_chief, chief.num_workers) == (0, True, 3)
    assert (worker0.worker_index, worker0.is_chief, worker0.own_address) == (1, False, W2[0])
    assert (evaluator.worker_index, evaluator.is_chief) == (None, False)
    assert chief.addresses == ["c:1"] + W2 + ["e:9"]


def test_load_reads_the_environment():
    info = tf_config.load({"TF_CONFIG": tf_config.make(W2, 1)})
    assert (info.task_type, info.task_index, info.own_address) == ("worker", 1, W2[1])
    with pytest.raises(ConfigError, match=r"TF_CONFIG\.task\.index"):
        tf_config.load({"TF_CONFIG": cfg({"worker": W2}, {"type": "worker", "index": 5})})


def test_make_rejects_what_parse_would():
    with pytest.raises(ConfigError, match=r"TF_CONFIG\.task\.index"):
        tf_config.make(W2, 2)
    with pytest.raises(ConfigError, match=r"TF_CONFIG\.cluster\.worker\[1\]"):
        tf_config.make(["a:1", "a:1"], 0)


@given(ports=st.lists(st.integers(1, 65535), min_size=1, max_size=8, unique=True),
       data=st.data())
def test_make_round_trips(ports, data):
    addresses = [f"127.0.0.1:{p}" for p in ports]
    index = data.draw(st.integers(0, len(ports) - 1))
    info = tf_config.parse(tf_config.make(addresses, index))
    assert info.cluster == {"worker": addresses}
    assert (info.worker_index, info.num_workers, info.own_address) == (index, len(ports),
                                                                       addresses[index])
    assert info.is_chief == (index == 0)


def test_does_not_import_tensorflow():
    out = run_python("import sys, tfpar.tf_config, tfpar.launch; "
                     "print('tensorflow' in sys.modules)", timeout=60, fresh=True)
    assert out.stdout.strip() == "False"
