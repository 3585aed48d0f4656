"""A run with a lossy aggregator that is stopped and resumed from its checkpoint has the same
per-step losses and ends with the same weights, bit for bit, as an uninterrupted run: every
replica gets its own error-feedback residual back (restoring the mean instead would change
what each replica sends after the resume)."""

import json
import sys

import numpy as np

from subproc import ROOT, last_json_line, run, run_concurrently
from subproc import saved_arrays as _weights

CHILD = f"{ROOT}/tests/train_child.py"
RUNS_CHILD = f"{ROOT}/tests/train_runs_child.py"
CONFIG = {"compression": "int8", "error_feedback": True, "cpu_devices": 4, "strategy": "mirrored",
          "global_batch_size": 64, "steps_per_epoch": 4, "optimizer": "momentum",
          "learning_rate": 0.05, "verbose": 0}


def test_int8_resume_is_exact_per_replica(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # The first part, then the resume in a fresh process (as a restarted job would run it);
    # meanwhile the uninterrupted run in a child of its own (tests/train_runs_child.py).
    def first_then_resumed():
        first = last_json_line(run([sys.executable, RUNS_CHILD, json.dumps([[
            "first", {**CONFIG, "steps": 5, "checkpoint_dir": ckpt, "checkpoint_every": 5}]]),
            str(tmp_path / "run")], timeout=300).stdout)["first"]
        out = run([sys.executable, CHILD, json.dumps({**CONFIG, "steps": 10,
                                                      "checkpoint_dir": ckpt,
                                                      "checkpoint_every": 5}),
                   str(tmp_path / "resumed")], timeout=240)
        return first, last_json_line(out.stdout)
    (first, resumed), whole = run_concurrently([first_then_resumed, lambda: last_json_line(
        run([sys.executable, RUNS_CHILD, json.dumps([["whole", {**CONFIG, "steps": 10}]]),
             str(tmp_path / "run")], timeout=300).stdout)["whole"]])
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


# The mesh's codecs (tfpar.layout.reduction) on a 2x2 mesh: residuals and PowerSGD's Qs
# saved under the weights' names (tfpar.state's `codec/...`).
MESH = {"model": "mlp", "tensor_parallel": 2, "data_parallel": 2, "cpu_devices": 4,
        "global_batch_size": 32, "steps_per_epoch": 4, "optimizer": "momentum",
        "learning_rate": 0.05, "verbose": 0}


def test_mesh_codec_resume_is_exact(tmp_path):
    from test_layout_compose import train_configs
    from test_train import weights
    # int8's residuals are lowbit's (the same `residual` rows, tfpar.layout.reduction); its
    # mesh resume, onto another data-parallel degree, is tests/test_reshard.py's int8_dp2.
    codecs = ("powersgd", "lowbit")
    configs = {c: {**MESH, "compression": c, "powersgd_rank": 2,
                   "checkpoint_dir": str(tmp_path / c), "checkpoint_every": 5}
               for c in codecs}
    # The first halves, then the resumes in a fresh process (as a restarted job would run
    # them); meanwhile the uninterrupted runs in a child of their own (one mesh per
    # process; a run on a fresh runtime equals a later run on a used one, bit for bit:
    # tests/test_train.py). Three runs' tracing at a time each, not six and then three.
    def first_then_resumed():
        train_configs(str(tmp_path / "first"), [{**configs[c], "steps": 5} for c in codecs])
        return train_configs(str(tmp_path / "resumed"),
                             [{**configs[c], "steps": 10} for c in codecs])[None]
    resumed, whole_runs = run_concurrently([first_then_resumed, lambda: train_configs(
        str(tmp_path / "run"), [{k: v for k, v in configs[c].items()
                                 if not k.startswith("checkpoint")} | {"steps": 10}
                                for c in codecs])[None]])
    for i, codec in enumerate(codecs):
        whole, again = whole_runs[i], resumed[i]
        assert again["resumed_from_step"] == 5 and again["steps"] == 5
        assert whole["comm"]["compression_ratio"] > 1.5  # the codec ran
        # Without the residuals and Qs restored, the steps after the resume differ.
        np.testing.assert_array_equal(again["loss_history"], whole["loss_history"][5:])
        for a, b in zip(weights(str(tmp_path / f"resumed.{i}")),
                        weights(str(tmp_path / f"run.{i}")), strict=True):
            np.testing.assert_array_equal(a, b, f"{codec}: resumed weights differ")


def test_mesh_codec_state_moves_to_another_batch_axis_with_what_it_owes():
    out = last_json_line(run([sys.executable, f"{ROOT}/tests/mesh_codec_child.py", "reshard"],
                             timeout=300).stdout)["reshard"]
    if "error" in out:
        raise AssertionError(out["error"])
    for codec, result in out.items():
        assert any(n.endswith("/residual") for n in result["names"]), result["names"]
        assert result["largest"] > 0  # a residual to carry
        assert result["same_diff"] == 0.0, (codec, result)  # the same mesh: every entry
        # 2 rows onto 4: replica 0 takes what they owe (their sum x 4 / 2), the others
        # zero (tfpar.state).
        assert result["rows"] == [2, 4] and result["owed_diff"] == 0.0, (codec, result)
    assert any(n.endswith("/powersgd_q") for n in out["powersgd"]["names"])
    assert out["powersgd"]["q_diff"] == 0.0
