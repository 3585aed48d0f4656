"""Fuzzing flags and TF_CONFIG: every input either trains or ends in one clear line.

In-process, hypothesis drives many values through the same validation the CLI runs
(`config_from_flags`, `tf_config.parse`, and the checks of `strategy.choose_kind`): only
`ConfigError` may come out. A few sampled inputs then go through the real CLI in child
processes (forked from one child, tests/cli_child.py): exit 0, or a non-zero exit with one
`tfpar: error:` line and no traceback.
"""

import json

from absl import flags
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from subproc import run_cli_cases
from tfpar import flags as tfpar_flags
from tfpar import tf_config
from tfpar.errors import ConfigError

INTS = st.one_of(st.integers(-5, 300), st.sampled_from([0, 1, 2, 3, 4, 7, 64, 10 ** 9]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-3]))
FLAG_VALUES = {
    "model": st.sampled_from(["mlp", "transformer", "convnet", "bogus", ""]),
    "global_batch_size": INTS, "steps": INTS, "steps_per_epoch": INTS,
    "grad_accum_steps": INTS, "cpu_devices": INTS, "microbatches": INTS,
    "learning_rate": FLOATS, "topk_ratio": FLOATS, "bucket_mb": FLOATS,
    "compression": st.sampled_from(["none", "fp16", "int8", "topk", "zip"]),
    "strategy": st.sampled_from(["auto", "mirrored", "one_device", "multi_worker", "x"]),
    "dataset": st.sampled_from(["auto", "a:b", "nope", "x.y:z", ":"]),
}


def parse(argv):
    values = flags.FlagValues()
    tfpar_flags.define_flags(values)
    try:
        values(["tfpar.train", *argv])
    except flags.Error as err:  # absl's own one-line parse errors
        return err
    try:
        return tfpar_flags.config_from_flags(values)
    except ConfigError as err:
        return err


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(FLAG_VALUES)), st.none()).flatmap(
    lambda keys: st.fixed_dictionaries({k: FLAG_VALUES[k] for k in keys})))
def test_any_flags_validate_or_raise_config_error(chosen):
    result = parse([f"--{k}={v}" for k, v in chosen.items()])
    if isinstance(result, ConfigError):
        assert result.setting.startswith("--") and "\n" not in str(result)


ADDRESS = st.one_of(st.sampled_from(["localhost:2222", "127.0.0.1:1", "[::1]:80", "h:0",
                                     "h:65536", "noport", "", "a:b", "h:2222"]),
                    st.text(max_size=12))
TF_CONFIGS = st.one_of(
    st.text(max_size=40),
    st.builds(lambda c, t: json.dumps({"cluster": c, "task": t}),
              st.dictionaries(st.sampled_from(["worker", "chief", "ps", "evaluator", "x"]),
                              st.lists(ADDRESS, max_size=3), max_size=3),
              st.fixed_dictionaries({"type": st.sampled_from(["worker", "chief", "ps", 1]),
                                     "index": st.one_of(st.integers(-2, 4), st.just("0"))})),
    st.builds(json.dumps, st.one_of(st.none(), st.integers(), st.lists(st.integers()))))


@settings(max_examples=500, deadline=None)
@given(TF_CONFIGS)
def test_any_tf_config_parses_or_raises_config_error(raw):
    try:
        info = tf_config.parse(raw)
    except ConfigError as err:
        assert err.setting.startswith("TF_CONFIG") and "\n" not in str(err)
        return
    if info is not None:
        assert 0 <= info.task_index < len(info.cluster[info.task_type])


CLI_CASES = [
    ["--steps=2", "--global_batch_size=7", "--cpu_devices=2"],
    ["--steps=2", "--model=transformer", "--microbatches=3"],
    ["--steps=2", "--strategy=multi_worker"],
    ["--steps=2", "--compression=int8", "--topk_ratio=0"],
    ["--steps=2", "--dataset=missing_module:fn", "--num_classes=3"],
    ["--steps=2", "--cpu_devices=2", "--data_parallel=3", "--strategy=mirrored"],
    ["--steps=abc"],
    ["--steps=2", "--model=convnet", "--cpu_devices=2", "--global_batch_size=8"],
]


def test_sampled_inputs_through_the_cli_train_or_fail_in_one_line():
    # One child for all (`run_cli_cases`: TensorFlow imported once, a process forked per
    # input running the command line).
    outs = run_cli_cases([(["--verbose=0", *argv], None) for argv in CLI_CASES], timeout=400)
    for argv, out in zip(CLI_CASES, outs):
        assert "Traceback" not in out.stderr, (argv, out.stderr[-2000:])
        if out.returncode:
            errors = [line for line in out.stderr.splitlines()
                      if line.startswith(("tfpar: error:", "FATAL Flags parsing error"))]
            assert len(errors) == 1, (argv, out.stderr[-2000:])
        else:
            assert "tfpar: strategy=" in out.stdout, argv
