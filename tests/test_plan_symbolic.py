"""User models profiled by a symbolic trace: no weight allocated, the same numbers as the
formulas for the built-in models, and `--model=module:function` through the CLI."""

import json
import os
import sys

import pytest

from subproc import ROOT, run


def _trace_builtin(name, width, depth):
    """The traced profile of the real built-in model (weights deferred), in this process."""
    from tfpar.plan import profile, symbolic

    with symbolic.deferred_weights():
        model = profile.build_builtin(name, width, depth)
    assert all(w._value is None for w in model.weights)  # never created
    return symbolic.profile_traced(model, model.inputs, name)


@pytest.mark.parametrize("name,width,depth", [("transformer", 64, 2), ("mlp", 256, 3),
                                              ("convnet", 32, 2)])
def test_trace_agrees_with_the_formulas(name, width, depth):
    from tfpar.plan import profile

    traced = _trace_builtin(name, width, depth)
    formula = profile.builtin_profile(name, width, depth)
    assert traced.params == formula.params
    assert traced.flops_per_example == pytest.approx(formula.flops_per_example, rel=0.02)
    # The trace counts every tensor a gradient reads, normalisations' intermediates too.
    ratio = traced.activation_bytes_per_example / formula.activation_bytes_per_example
    print(name, "traced / formula activation bytes:", round(ratio, 2))
    assert 0.9 <= ratio <= 2.2, ratio
    if name == "transformer":
        assert traced.max_tensor_parallel == 4 and traced.tp_syncs_per_block > 0
        assert traced.boundary_bytes_per_example == formula.boundary_bytes_per_example


def _cli(*flags, timeout=240):
    return run([sys.executable, os.path.join(ROOT, "tests", "plan_rss_child.py"),
                sys.executable, "-m", "tfpar.plan", *flags], timeout=timeout,
               env={"PYTHONPATH": os.path.join(ROOT, "tests")})


def test_user_model_without_inputs_is_planned_without_its_52_gb_of_weights():
    out = _cli("--model=user_plan_models:huge_sequential", "--devices=8", "--memory_gb=80",
               "--global_batch_size=64")
    report = json.loads(out.stdout)
    assert report["returncode"] == 0, report["stderr"]
    print(report["stdout"], f"{report['seconds']:.1f} s, peak {report['max_rss_mb']:.0f} MB")
    assert "12,885," in report["stdout"]  # 3 x 65536^2 + ... parameters
    assert report["max_rss_mb"] < 1500  # TensorFlow itself takes ~0.7 GB; weights: 52 GB


def test_user_model_plan_prints_python_calls():
    out = run([sys.executable, "-m", "tfpar.plan", "--model=user_plan_models:wide_mlp",
               "--devices=4", "--memory_gb=16", "--global_batch_size=256"], timeout=240,
              env={"PYTHONPATH": os.path.join(ROOT, "tests")})
    assert "from user_plan_models import wide_mlp" in out.stdout
    assert "run: python -m tfpar.train" not in out.stdout  # tfpar.train has no user models


def test_bad_user_model_is_one_line():
    out = run([sys.executable, "-m", "tfpar.plan", "--model=user_plan_models:not_a_model",
               "--devices=4"], timeout=240, check=False,
              env={"PYTHONPATH": os.path.join(ROOT, "tests")})
    assert out.returncode == 2
    assert "--model" in out.stderr or "model=" in out.stderr
    assert "Traceback" not in out.stderr
