"""tfpar as a library: importing it defines no flag and runs no circle; `--help` lists the
flags; one compatibility table refuses what a backend cannot honour; a user's `--dataset`
function that does not fit gets one line saying what it must look like."""

import ast
import dataclasses
import json
import os
import sys

import pytest
from absl import flags

from subproc import ROOT, last_json_line, run, run_module
from tfpar import ConfigError, ParallelConfig, compat

IMPORTS_CHILD = os.path.join(ROOT, "tests", "imports_child.py")
# Modules a console script (or `python -m`) runs: the only ones that may import tfpar.train.
ENTRY_POINTS = {"tfpar.train", "tfpar.launch", "tfpar.doctor", "tfpar.report",
                "tfpar.plan.__main__"}


def tfpar_sources():
    """{module name: source file} of tfpar, with the zoo (the top-level `models/`) as
    `tfpar.models`."""
    sources = {}
    for top, package in (("tfpar", "tfpar"), ("models", "tfpar.models")):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, os.path.join(ROOT, top))[:-3]
                    dotted = f"{package}.{dotted.replace(os.sep, '.')}"
                    sources[dotted.removesuffix(".__init__")] = path
    return sources


def tfpar_modules():
    return sorted(tfpar_sources())


def test_importing_any_module_defines_no_flag():
    own = {f.name for f in dataclasses.fields(ParallelConfig)}
    names = sorted(own) + ["workers", "grace", "max_restarts", "out_dir", "peer_timeout_s",
                           "devices", "calibrate", "tflops"]
    out = run([sys.executable, IMPORTS_CHILD, "flags", json.dumps(tfpar_modules()),
               json.dumps(names)], timeout=180)
    result = last_json_line(out.stdout)
    assert result["defined"] == []
    assert {"compression", "workers", "out_dir", "peer_timeout_s", "tflops"} <= set(
        result["entry_flags"])


def test_a_user_flag_of_the_same_name_does_not_clash():
    values = flags.FlagValues()
    flags.DEFINE_integer("steps", 5, "the user's own --steps", flag_values=values)
    import tfpar.train  # noqa: F401  (imported: defines nothing)
    values(["script", "--steps=7"])
    assert values.steps == 7


def test_every_module_imports_alone():
    """Each module first in a fresh interpreter (third-party packages preloaded, then one
    fork per module): an import circle fails the module that starts it."""
    out = run([sys.executable, IMPORTS_CHILD, "alone", json.dumps(tfpar_modules())],
              timeout=300)
    assert last_json_line(out.stdout) == {}


def test_only_entry_points_import_the_trainer():
    importers = []
    for name, path in sorted(tfpar_sources().items()):
        if name in ENTRY_POINTS:
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                if any(a.name == "tfpar.train" for a in node.names):
                    importers.append(name)
            elif isinstance(node, ast.ImportFrom):
                if node.module == "tfpar.train" or (
                        node.module == "tfpar" and any(a.name == "train" for a in node.names)):
                    importers.append(name)
    assert importers == []


@pytest.mark.parametrize("module,flag", [("tfpar.train", "--compression"),
                                         ("tfpar.train", "--validation_steps"),
                                         ("tfpar.launch", "--max_restarts"),
                                         ("tfpar.doctor", "--peer_timeout_s")])
def test_help_lists_the_flags(module, flag, help_output):
    stdout = help_output(module)
    assert flag in stdout, stdout[-2000:]


@pytest.fixture(scope="module")
def help_output():
    """`python -m MODULE --help`'s stdout, run once per module (two flags are looked up in
    tfpar.train's)."""
    outputs = {}

    def get(module):
        if module not in outputs:
            outputs[module] = run_module(module, "--help", check=False, timeout=120).stdout
        return outputs[module]
    return get


# The compatibility table: every refusal is one ConfigError line naming the setting.
BACKEND_BASE = {"data_parallel": {}, "pipeline": {"pipeline_stages": 2},
                "dtensor": {"tensor_parallel": 2, "model": "transformer"},
                "tf_keras": {"keras": 2}}
OTHER_VALUE = {"mixed_precision": "fp16", "compression": "auto", "grad_accum_steps": 2,
               "pipeline_stages": 2, "tensor_parallel": 2, "strategy": "multi_worker",
               "model": "transformer", "checkpoint_dir": "/tmp/ckpt", "on_nan": "skip_step",
               "tensorboard_dir": "/tmp/tb", "measure_comm": True, "recompute": "full",
               "zero_stage": 1, "sequence_parallel": True, "adam_warmup_steps": 10,
               "offload": "optimizer", "allreduce": "hierarchical"}
REFUSALS = [(setting, backend) for setting, rules in compat.TABLE.items() for backend in rules]


def test_every_row_of_the_table_has_a_test_value():
    assert set(compat.TABLE) <= set(OTHER_VALUE)
    assert {b for rules in compat.TABLE.values() for b in rules} <= set(compat.BACKENDS)


@pytest.mark.parametrize("setting,backend", REFUSALS)
def test_the_table_refuses_with_one_line(setting, backend):
    settings = {**BACKEND_BASE[backend], setting: OTHER_VALUE[setting]}
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**settings)
    assert info.value.setting == setting
    assert "\n" not in str(info.value)
    assert compat.TABLE[setting][backend][1] in str(info.value)


@pytest.mark.parametrize("backend", list(BACKEND_BASE))
def test_each_backend_takes_its_base_config_and_validation(backend):
    config = ParallelConfig(**BACKEND_BASE[backend], validation_steps=2)
    assert compat.backend_of(config) == backend


def test_the_cli_refuses_before_tensorflow_starts():
    out = run_module("tfpar.train", "--tensor_parallel=2", "--model=transformer",
                     "--on_nan=skip_step", check=False, timeout=120, fresh=True)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("tfpar: error: --on_nan='skip_step' is invalid: "
                                "not supported with --tensor_parallel>1")


# A user's --dataset function that does not fit.
@pytest.mark.parametrize("function,words", [
    ("takes_only_config", "its signature is takes_only_config(config)"),
    ("returns_a_list", "it returned a list"),
    ("unbatched", "not batched?"),
    ("float_labels", "its labels y are float32"),
    ("global_batches", "its batches hold [128] examples"),
])
def test_a_dataset_function_that_does_not_fit_is_one_line(function, words):
    from tfpar import data
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        with pytest.raises(ConfigError) as info:
            data.make_task(ParallelConfig(dataset=f"user_data:{function}", num_classes=2))
    finally:
        sys.path.remove(os.path.join(ROOT, "tests"))
    message = str(info.value)
    assert info.value.setting == "dataset" and "\n" not in message
    assert words in message
    assert "must be a function (input_context, config) -> tf.data.Dataset" in message


def test_the_cli_says_what_a_dataset_function_must_look_like():
    out = run_module("tfpar.train", "--dataset=user_data:takes_only_config", "--num_classes=2",
                     env={"PYTHONPATH": os.path.join(ROOT, "tests")}, check=False, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "tfpar: error: dataset='user_data:takes_only_config' is invalid: its signature is")
