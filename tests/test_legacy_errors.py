"""What the legacy-Keras front (and tfmot under a strategy) refuses: one clear ConfigError
naming the setting, raised before any model is built."""

import json
import os
import sys

import pytest

from subproc import ROOT, last_json_line, run
from tfpar import ConfigError, ParallelConfig
from tfpar.legacy import options

Config = ParallelConfig


def refused(**settings):
    with pytest.raises(ConfigError) as info:
        options.check(Config(**settings))
    return info.value


@pytest.mark.parametrize("settings,setting,words", [
    ({"keras": 3, "prune_sparsity": 0.5}, "prune_sparsity", "--keras=2"),
    ({"keras": 3, "qat": True}, "qat", "--keras=2"),
    ({"keras": 1}, "keras", "choose 3"),
    ({"keras": 2, "model": "transformer"}, "model", "mlp or convnet"),
    ({"keras": 2, "pipeline_stages": 2}, "pipeline_stages", "Keras 3 only"),
    ({"keras": 2, "tensor_parallel": 2}, "tensor_parallel", "Keras 3 only"),
    ({"keras": 2, "grad_accum_steps": 2}, "grad_accum_steps", "accumulate"),
    ({"keras": 2, "on_nan": "skip_step"}, "on_nan", "Keras 3 only"),
    ({"keras": 2, "qat": True, "mixed_precision": "bf16"}, "mixed_precision", "--qat"),
    ({"keras": 2, "qat": True, "prune_sparsity": 0.5}, "qat", "choose one"),
    ({"keras": 2, "prune_sparsity": 1.0}, "prune_sparsity", "[0, 1)"),
    ({"keras": 2, "prune_sparsity": 0.5, "steps": 40, "prune_end_step": 35,
      "prune_frequency": 10}, "prune_end_step", "try 30"),
    ({"keras": 2, "prune_sparsity": 0.5, "steps": 40, "prune_end_step": 50},
     "prune_end_step", "steps=40"),
    ({"keras": 2, "prune_sparsity": 0.5, "prune_initial_sparsity": 0.7},
     "prune_initial_sparsity", "prune_sparsity=0.5"),
])
def test_unsupported_settings_are_one_clear_error(settings, setting, words):
    err = refused(**settings)
    assert err.setting == setting
    assert words in str(err)


def test_supported_settings_pass():
    options.check(Config(keras=2, prune_sparsity=0.8, steps=200))  # end step 200
    options.check(Config(keras=2, prune_sparsity=0.5, mixed_precision="bf16"))
    options.check(Config(keras=2, qat=True))
    options.check(Config(keras=3))
    options.check(ParallelConfig())  # a config without the legacy fields: Keras 3, no tfmot
    assert options.prune_end_step(Config(steps=95, prune_frequency=10, prune_begin_step=3)) == 93


def test_qat_of_a_layer_tfmot_cannot_quantize_names_it():
    out = run([sys.executable, os.path.join(ROOT, "tests", "qat_refusal_child.py")],
              timeout=120)
    err = last_json_line(out.stdout)
    assert err["setting"] == "qat"
    assert "stem_norm" in err["message"] and "GroupNormalization" in err["message"]
    assert "\\n" not in json.dumps(err["message"])  # one line
