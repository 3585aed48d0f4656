"""A run with a lossy aggregator that is stopped and resumed from its checkpoint has the same
per-step losses and ends with the same weights, bit for bit, as an uninterrupted run: every
replica gets its own error-feedback residual back (restoring the mean instead would change
what each replica sends after the resume)."""

import json
import sys

import numpy as np

from subproc import ROOT, last_json_line, run

CHILD = f"{ROOT}/tests/train_child.py"
RUNS_CHILD = f"{ROOT}/tests/train_runs_child.py"
CONFIG = {"compression": "int8", "error_feedback": True, "cpu_devices": 4, "strategy": "mirrored",
          "global_batch_size": 64, "steps_per_epoch": 4, "optimizer": "momentum",
          "learning_rate": 0.05, "verbose": 0}


def _weights(path):
    weights = np.load(path)
    return [weights[k] for k in sorted(weights, key=lambda k: int(k.split("_")[1]))]


def test_int8_resume_is_exact_per_replica(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # The first part and the uninterrupted run in one child (tests/train_runs_child.py); the
    # resume in a fresh process, as a restarted job would.
    runs = [["first", {**CONFIG, "steps": 5, "checkpoint_dir": ckpt, "checkpoint_every": 5}],
            ["whole", {**CONFIG, "steps": 10}]]
    out = run([sys.executable, RUNS_CHILD, json.dumps(runs), str(tmp_path / "run")],
              timeout=300)
    first, whole = (last_json_line(out.stdout)[name] for name in ("first", "whole"))
    out = run([sys.executable, CHILD, json.dumps({**CONFIG, "steps": 10, "checkpoint_dir": ckpt,
                                                  "checkpoint_every": 5}),
               str(tmp_path / "resumed")], timeout=240)
    resumed = last_json_line(out.stdout)
    assert first["replicas"] == 4 and first["steps"] == 5
    assert resumed["resumed_from_step"] == 5 and resumed["steps"] == 5
    # The same replicas, weights, slots, residuals and data position: the same numbers. Each
    # step's loss is the one its train step computed (tfpar.metrics.report_step_loss), not
    # rebuilt from Keras's running mean (which restarts on resume, with other rounding).
    np.testing.assert_array_equal(resumed["loss_history"], whole["loss_history"][5:])
    for a, b in zip(_weights(tmp_path / "resumed.npz"), _weights(tmp_path / "run_whole.npz"),
                    strict=True):
        np.testing.assert_array_equal(a, b, "resumed run's weights differ from the "
                                            "uninterrupted run's")


def test_residuals_restored_where_the_saved_rows_are_counted_only_at_run_time():
    # A checkpoint spanning several tasks (a pipeline across workers) is restored inside a
    # tf.function: the replicas compare the rows' count there, not while tracing.
    out = last_json_line(run([sys.executable, f"{ROOT}/tests/per_replica_restore_child.py"],
                             timeout=120).stdout)
    assert out["same"] == [[1, 2, 3], [4, 5, 6]]
    assert out["other"] == [[12, 15, 18], [0, 0, 0]]
    assert out["other_average"] == [[4, 5, 6], [4, 5, 6]]
