"""A run with a lossy aggregator that is stopped and resumed from its checkpoint ends with the
same weights as an uninterrupted run: every replica gets its own error-feedback residual
back (restoring the mean instead would change what each replica sends after the resume)."""

import json
import sys

import numpy as np

from subproc import ROOT, last_json_line, run

CHILD = f"{ROOT}/tests/train_child.py"


def _train(tmp_path, name, **settings):
    config = {"compression": "int8", "error_feedback": True, "cpu_devices": 4,
              "strategy": "mirrored", "global_batch_size": 64, "steps_per_epoch": 4,
              "optimizer": "momentum", "learning_rate": 0.05, "verbose": 0, **settings}
    out = run([sys.executable, CHILD, json.dumps(config), str(tmp_path / name)], timeout=240)
    weights = np.load(tmp_path / f"{name}.npz")
    return last_json_line(out.stdout), [weights[k] for k in sorted(weights, key=lambda k:
                                                                    int(k.split("_")[1]))]


def test_int8_resume_is_exact_per_replica(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first, _ = _train(tmp_path, "first", steps=5, checkpoint_dir=ckpt, checkpoint_every=5)
    resumed, w_resumed = _train(tmp_path, "resumed", steps=10, checkpoint_dir=ckpt,
                                checkpoint_every=5)
    whole, w_whole = _train(tmp_path, "whole", steps=10)
    assert first["replicas"] == 4 and first["steps"] == 5
    assert resumed["resumed_from_step"] == 5 and resumed["steps"] == 5
    # Batch losses are recovered from Keras's running mean, which restarts on resume.
    np.testing.assert_allclose(resumed["loss_history"], whole["loss_history"][5:], rtol=1e-5)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(w_resumed, w_whole))
    assert diff <= 1e-6, f"resumed run differs from the uninterrupted one by {diff}"
