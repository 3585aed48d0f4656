"""Resume on another world size: a checkpoint written by N replicas restores on M != N.

The run with a lossy aggregator (int8, error feedback) is stopped at a checkpoint and resumed
on another replica count: the error-feedback residuals come back with their sum over replicas
kept exactly (replica 0 takes the sum), the data continues at the same example, the global
batch is kept, and each resumed step's loss is within 1e-4 (relative) of the uninterrupted
run's, the resume step's within 1e-6.
"""

import json
import shutil
import sys

import numpy as np
import pytest

from subproc import ROOT, last_json_line, outcome, run, run_concurrently

RUNS = f"{ROOT}/tests/train_runs_child.py"
RESTORE = f"{ROOT}/tests/elastic_child.py"
BASE = {"compression": "int8", "error_feedback": True, "strategy": "mirrored",
        "global_batch_size": 64, "steps_per_epoch": 4, "optimizer": "momentum",
        "learning_rate": 0.05, "verbose": 0}
CASES = [(4, 2), (2, 4)]


def _first_and_whole(folder, before):
    """One child on `before` replicas: 6 steps saved to `folder/ckpt`, then the
    uninterrupted 12 steps (tests/train_runs_child.py)."""
    runs = [["first", {**BASE, "cpu_devices": before, "steps": 6,
                       "checkpoint_dir": str(folder / "ckpt"), "checkpoint_every": 6}],
            ["whole", {**BASE, "cpu_devices": before, "steps": 12}]]
    out = run([sys.executable, RUNS, json.dumps(runs), str(folder / "run")], timeout=300)
    return last_json_line(out.stdout)


def _restore_and_resume(folder, after):
    """One child on `after` replicas: the residuals as restored from `folder/ckpt`, before
    any step (tests/elastic_child.py), then the run resumed from a copy made first
    (restoring records the change of world size in the directory it restores from)."""
    shutil.copytree(folder / "ckpt", folder / "ckpt_train")
    config = {**BASE, "cpu_devices": after, "steps": 12, "checkpoint_dir": str(folder / "ckpt"),
              "checkpoint_every": 6}
    resume = {**config, "checkpoint_dir": str(folder / "ckpt_train"),
              "metrics_json": str(folder / "resumed.json")}
    out = run([sys.executable, RESTORE, json.dumps(config), str(folder / "res.npz"),
               json.dumps(resume)], timeout=300)
    return last_json_line(out.stdout), out.stderr.split("elastic_child: training\n", 1)[1]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Both cases at once, in two rounds of two children (4 TensorFlow starts in all):
    {(before, after): (folder, first and whole, restore report, resumed run's stderr)},
    each value the AssertionError its child failed with if one failed. The folders are
    made before the threads start (two first `mktemp`s at once can delete each other's)."""
    folders = [tmp_path_factory.mktemp(f"elastic_{b}_to_{a}") for b, a in CASES]
    trained = run_concurrently([lambda f=f, b=b: _first_and_whole(f, b)
                                for f, (b, _) in zip(folders, CASES)], keep_failures=True)
    ok = [not isinstance(t, AssertionError) for t in trained]
    restored = run_concurrently([lambda f=f, a=a: _restore_and_resume(f, a)
                                 for f, (_, a), good in zip(folders, CASES, ok) if good],
                                keep_failures=True)
    restored = iter(restored)
    return {case: (f, t, next(restored)) if good else t
            for case, f, t, good in zip(CASES, folders, trained, ok)}


@pytest.mark.parametrize("before,after", CASES)
def test_resume_on_another_replica_count(resumed, before, after, report_measured):
    folder, trained, restore_run = outcome(resumed[(before, after)])
    first, whole = trained["first"], trained["whole"]
    assert first["replicas"] == before and first["steps"] == 6

    # The residuals as restored on `after` replicas, before any step.
    info, err = outcome(restore_run)
    assert info["step"] == 6 and info["replicas"] == after
    assert info["elastic"] == [{"step": 6, "workers": 1, "replicas": after}]
    res = np.load(folder / "res.npz")
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

    resumed_run = info["train"]
    assert resumed_run["resumed_from_step"] == 6 and resumed_run["steps"] == 6
    assert "world size changed at step 6" in err
    assert "residuals re-distributed with what they owe kept" in err  # int8, error feedback
    with open(folder / "resumed.json") as f:
        assert json.load(f)["elastic"] == [{"step": 6, "workers": 1, "replicas": after}]
    losses = np.array(resumed_run["loss_history"])
    reference = np.array(whole["loss_history"][6:])
    gaps = np.abs(losses - reference) / reference
    report_measured(f"resume {before} -> {after} replicas (int8): relative gap to the "
                    f"uninterrupted run per resumed step {' '.join(f'{g:.1e}' for g in gaps)}; "
                    f"final {losses[-1]:.6f} vs {reference[-1]:.6f}")
    # The resume step's loss comes from the restored weights on the same examples: only the
    # order of the sum over replicas differs (measured 0 and 1.3e-7, one float32 ulp).
    assert gaps[0] <= 1e-6, gaps
    # Later steps differ for real: int8 rounds each replica's gradient and the replicas'
    # slices change with their count (measured at most 6.0e-6 over the 5 steps).
    assert gaps.max() <= 1e-4, gaps


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
