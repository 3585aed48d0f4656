"""`--cpu_kernels`: the trainer picks TensorFlow's CPU kernels before TensorFlow starts, so a
command runs the same kernels on every processor (TensorFlow's own default depends on it).

Each run is a fresh `python -m tfpar.train` (TensorFlow reads the choice once, when it is
imported): the metrics JSON's `cpu_kernels` is what TensorFlow itself reports running, so
a choice that did not reach it fails here.
"""

import json
import sys

import pytest

from subproc import run_concurrently, run_module

from tfpar import cpu_kernels
from tfpar.errors import ConfigError

ARGS = ("--verbose=0", "--steps=6", "--cpu_devices=2", "--global_batch_size=32")


def _train(tmp_path, name, flag, env_value):
    """One run; `env_value` None: the child runs without the variable (not the suite's)."""
    out = tmp_path / f"{name}.json"
    argv = [*ARGS, f"--metrics_json={out}"] + ([f"--cpu_kernels={flag}"] if flag else [])
    run_module("tfpar.train", *argv, timeout=180, env={cpu_kernels.ENV: env_value},
               fresh=True)  # a new interpreter: the variable is read at import
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernels")
    cases = {  # name -> (--cpu_kernels, TF_ENABLE_ONEDNN_OPTS in the environment)
        # oneDNN whatever TensorFlow's rule for this CPU (on a CPU where TensorFlow's own
        # default is oneDNN too, this case cannot tell the two apart; the others can)
        "default_unset": (None, None),
        "auto_env_off": ("auto", "0"),  # the user's variable wins under auto
        "onednn_env_off": ("onednn", "0"),  # an explicit choice wins over it
        "eigen": ("eigen", None),
    }
    return dict(zip(cases, run_concurrently(
        [lambda n=n: _train(tmp, n, *cases[n]) for n in cases])))


def test_the_trainer_runs_the_kernels_asked_for(runs):
    assert runs["default_unset"]["cpu_kernels"] == "onednn"
    assert runs["auto_env_off"]["cpu_kernels"] == "eigen"
    assert runs["onednn_env_off"]["cpu_kernels"] == "onednn"
    assert runs["eigen"]["cpu_kernels"] == "eigen"
    assert runs["eigen"]["config"]["cpu_kernels"] == "eigen"


def test_both_kernel_sets_train_the_same_run(runs, report_measured):
    """Same seed and batches: oneDNN and Eigen round differently, nothing more (6 Adam
    steps, 2 replicas: losses within 1e-3 relative at every step)."""
    a, b = runs["default_unset"]["loss_history"], runs["eigen"]["loss_history"]
    assert len(a) == len(b) == 6
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    report_measured(f"cpu_kernels: oneDNN vs Eigen, 6 steps: worst relative loss gap "
                    f"{worst:.2e}")
    assert worst < 1e-3, (a, b)


def test_an_explicit_choice_tensorflow_cannot_honour_is_one_line(monkeypatch):
    """TensorFlow already imported with other kernels: `train` cannot switch them."""
    monkeypatch.setitem(sys.modules, "tensorflow", sys.modules.get("tensorflow", object()))
    monkeypatch.setattr(cpu_kernels, "active", lambda: "eigen")
    with pytest.raises(ConfigError) as err:
        cpu_kernels.apply("onednn", {cpu_kernels.ENV: "0"})
    message = str(err.value)
    assert "cpu_kernels" in message and "onednn" in message and "imported before" in message
    assert "TF_ENABLE_ONEDNN_OPTS=1" in message and "\n" not in message
    # The variable was right, TensorFlow still runs Eigen: not "imported before".
    with pytest.raises(ConfigError, match="runs eigen kernels although"):
        cpu_kernels.apply("onednn", {cpu_kernels.ENV: "true"})
    assert cpu_kernels.apply("auto", {}) == "eigen"
    assert cpu_kernels.apply("eigen", {}) == "eigen"


def test_select_sets_the_variable_tensorflow_reads():
    env = {cpu_kernels.ENV: "false"}
    assert cpu_kernels.select("auto", env) == "eigen" and env[cpu_kernels.ENV] == "0"
    assert cpu_kernels.select("onednn", env) == "onednn" and env[cpu_kernels.ENV] == "1"
    # What TensorFlow does not read is refused, not guessed (it would ignore it).
    with pytest.raises(ConfigError, match="TF_ENABLE_ONEDNN_OPTS='off'"):
        cpu_kernels.select("auto", {cpu_kernels.ENV: "off"})
    assert cpu_kernels.select("eigen", {cpu_kernels.ENV: "off"}) == "eigen"
    for bad in (lambda: cpu_kernels.select("mkl", {}),
                lambda: __import__("tfpar").ParallelConfig(cpu_kernels="mkl")):
        with pytest.raises(ConfigError, match="cpu_kernels='mkl'"):
            bad()
