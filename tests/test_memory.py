"""Memory per device and activation recomputation (`tfpar.memory`, `tfpar.recompute`).

Every run is a child process (tests/train_child.py) writing the metrics JSON. Recomputation
runs the same ops on the same inputs, so weights after 5 steps must equal the run without
it within 1e-6 (SGD, momentum) / 1e-5 (Adam); the training peak above what was resident
when training began (activations, gradients, temporaries) must drop.
"""

import json
import os
import sys

import numpy as np
import pytest

from subproc import ROOT, last_json_line, run
from tfpar import ParallelConfig
from tfpar.errors import ConfigError

CHILD = os.path.join(ROOT, "tests", "train_child.py")
BASE = {"steps": 5, "steps_per_epoch": 5, "verbose": 0, "global_batch_size": 32}


def train_child(tmp_path, name, **config):
    prefix = str(tmp_path / name)
    metrics_path = prefix + ".json"
    run([sys.executable, CHILD, json.dumps({**BASE, **config, "metrics_json": metrics_path}),
         prefix], timeout=300)
    with open(metrics_path) as f:
        result = json.load(f)
    data = np.load(prefix + ".npz")
    weights = [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]
    return result, weights


def max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def test_memory_block_counts_mirrored_variables_on_every_device(tmp_path):
    result, weights = train_child(tmp_path, "mirrored", model="mlp", optimizer="adam",
                                  strategy="mirrored", cpu_devices=4)
    memory = result["memory"]
    param_bytes = sum(w.size * w.itemsize for w in weights)
    assert len(memory["devices"]) == 4
    # Mirrored: every replica holds all parameters, and Adam's two slots of each.
    assert memory["param_bytes_per_device"] == [param_bytes] * 4
    for slots in memory["optimizer_state_bytes_per_device"]:
        assert 2 * param_bytes <= slots <= 2 * param_bytes + 64  # + iteration counter, lr
    # Logical CPUs share one BFC allocator (set by tfpar.train before TensorFlow starts).
    assert memory["peak_bytes_scope"] == "process"
    peaks = memory["peak_bytes_per_device"]
    assert len(set(peaks)) == 1 and peaks[0] > 4 * param_bytes
    assert 0 < memory["peak_bytes_above_start_per_device"][0] <= peaks[0]
    assert memory["peak_rss_mb"] > 0 and memory["params_per_device"]  # older keys kept


@pytest.mark.parametrize("optimizer,lr,tolerance,modes", [
    ("sgd", 0.05, 1e-6, ("blocks",)),
    ("adam", 1e-3, 1e-5, ("blocks",)),
])
def test_recompute_is_exact_and_lowers_the_activation_peak(tmp_path, optimizer, lr,
                                                           tolerance, modes):
    cfg = {"model": "transformer", "optimizer": optimizer, "learning_rate": lr,
           "strategy": "one_device", "global_batch_size": 64, "model_depth": 4}
    plain, w_plain = train_child(tmp_path, "none", **cfg)
    peak_plain = plain["memory"]["peak_bytes_above_start_per_device"][0]
    for mode in modes:
        result, w = train_child(tmp_path, mode, recompute=mode, **cfg)
        assert max_diff(w_plain, w) <= tolerance, mode
        peak = result["memory"]["peak_bytes_above_start_per_device"][0]
        print(f"{optimizer} recompute={mode}: training peak {peak} B vs {peak_plain} B "
              f"without ({peak_plain / peak:.2f}x lower)")
        assert peak * 2 <= peak_plain, (mode, peak, peak_plain)


def test_recompute_on_a_pipeline_is_exact(tmp_path):
    cfg = {"model": "mlp", "model_depth": 4, "optimizer": "momentum", "learning_rate": 0.05,
           "pipeline_stages": 2, "microbatches": 4, "cpu_devices": 2}
    _, w_plain = train_child(tmp_path, "none", **cfg)
    for mode in ("blocks", "full"):
        _, w = train_child(tmp_path, mode, recompute=mode, **cfg)
        assert max_diff(w_plain, w) <= 1e-6, mode


def test_unsupported_memory_settings_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="recompute"):
        ParallelConfig(tensor_parallel=2, recompute="blocks")
    with pytest.raises(ConfigError, match="recompute"):
        ParallelConfig(recompute="some")
    with pytest.raises(ConfigError, match="recompute.*blocks"):
        ParallelConfig(recompute="full")
    with pytest.raises(ConfigError, match="zero_stage.*build_on_mesh"):
        ParallelConfig(zero_stage=1, tensor_parallel=2)
    with pytest.raises(ConfigError, match="zero_stage"):
        ParallelConfig(zero_stage=4)
