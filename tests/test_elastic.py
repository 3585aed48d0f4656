"""Resume on another world size: a checkpoint written by N replicas restores on M != N.

The run with a lossy aggregator (int8, error feedback) is stopped at a checkpoint and resumed
on another replica count: the error-feedback residuals come back with their sum over replicas
kept exactly (replica 0 takes the sum), the data continues at the same example, the global
batch is kept, and the loss curve continues the uninterrupted run's.
"""

import json
import shutil
import sys

import numpy as np
import pytest

from subproc import ROOT, in_background, last_json_line, run

TRAIN = f"{ROOT}/tests/train_child.py"
RESTORE = f"{ROOT}/tests/elastic_child.py"
BASE = {"compression": "int8", "error_feedback": True, "strategy": "mirrored",
        "global_batch_size": 64, "steps_per_epoch": 4, "optimizer": "momentum",
        "learning_rate": 0.05, "verbose": 0}


def _train(tmp_path, name, **settings):
    config = {**BASE, **settings}
    out = run([sys.executable, TRAIN, json.dumps(config), str(tmp_path / name)], timeout=240)
    return last_json_line(out.stdout), out.stderr


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4)])
def test_resume_on_another_replica_count(tmp_path, before, after, report_measured):
    # The uninterrupted run needs nothing of the others: it trains while they do.
    whole_run = in_background(lambda: _train(tmp_path, "whole", cpu_devices=before, steps=12))
    ckpt = str(tmp_path / "ckpt")
    first, _ = _train(tmp_path, "first", cpu_devices=before, steps=6, checkpoint_dir=ckpt,
                      checkpoint_every=6)
    assert first["replicas"] == before and first["steps"] == 6
    # A copy for the training run (restoring records the change of world size in the
    # directory it restores from).
    shutil.copytree(ckpt, tmp_path / "ckpt_train")

    # The residuals as restored on `after` replicas, before any step.
    config = {**BASE, "cpu_devices": after, "steps": 12, "checkpoint_dir": ckpt,
              "checkpoint_every": 6}
    out = run([sys.executable, RESTORE, json.dumps(config), str(tmp_path / "res.npz")],
              timeout=240)
    info = last_json_line(out.stdout)
    assert info["step"] == 6 and info["replicas"] == after
    assert info["elastic"] == [{"step": 6, "workers": 1, "replicas": after}]
    res = np.load(tmp_path / "res.npz")
    keys = sorted(k[len("saved_"):] for k in res if k.startswith("saved_"))
    assert keys, "no error-feedback residual in the checkpoint"
    owed = 0.0
    for key in keys:
        saved, restored = res[f"saved_{key}"], res[f"restored_{key}"]
        assert saved.shape[0] == before and restored.shape[0] == after
        # Exactly the float32 sum the restore computed, and within float32 rounding of the
        # exact (float64) sum of the saved rows.
        np.testing.assert_array_equal(restored.sum(0), restored[0])
        np.testing.assert_allclose(restored.sum(0, dtype=np.float64),
                                   saved.sum(0, dtype=np.float64), rtol=0, atol=1e-6)
        owed += float(np.abs(saved.sum(0)).sum())
    assert owed > 0, "the residuals were all zero: the test would not see a lost sum"

    resumed, err = _train(tmp_path, "resumed", cpu_devices=after, steps=12,
                          checkpoint_dir=str(tmp_path / "ckpt_train"), checkpoint_every=6,
                          metrics_json=str(tmp_path / "resumed.json"))
    whole, _ = whole_run.result()
    assert resumed["resumed_from_step"] == 6 and resumed["steps"] == 6
    assert "world size changed at step 6" in err
    with open(tmp_path / "resumed.json") as f:
        assert json.load(f)["elastic"] == [{"step": 6, "workers": 1, "replicas": after}]
    losses, reference = np.array(resumed["loss_history"]), np.array(whole["loss_history"][6:])
    jump = abs(losses[0] - reference[0]) / reference[0]
    worst = float(np.max(np.abs(losses - reference) / reference))
    report_measured(f"resume {before} -> {after} replicas (int8): loss at the resume step "
                    f"{losses[0]:.5f} vs {reference[0]:.5f} uninterrupted ({jump:.2%}); worst "
                    f"step {worst:.2%}; final {losses[-1]:.5f} vs {reference[-1]:.5f}")
    assert jump <= 0.02
    assert worst <= 0.02


def test_data_position_is_the_same_for_any_split():
    """Steps 5..7 read the same examples, each once, whether 1, 2 or 4 pipelines × replicas
    split them: no example skipped or repeated when the world size changes at step 5."""
    import tensorflow as tf

    from tfpar import ParallelConfig, data

    config = ParallelConfig(global_batch_size=8)
    probe = type("Probe", (), {"user_fn": None,
                               "example_fn": staticmethod(lambda i: (i, i))})()
    expected = list(range(5 * 8, 8 * 8))
    for pipelines, replicas in ((1, 1), (1, 4), (2, 2), (2, 4), (4, 4)):
        seen = []
        for pipeline in range(pipelines):
            context = tf.distribute.InputContext(pipelines, pipeline, replicas)
            local = replicas // pipelines
            batches = list(data.pipeline_dataset(config, probe, context, 5).take(3 * local))
            seen += [int(i) for b in batches for i in b[0].numpy()]
        assert sorted(seen) == expected, (pipelines, replicas)
