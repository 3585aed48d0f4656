"""An elastic mesh job loses a worker and goes on re-laid out for the survivors
(`tfpar.relayout`, `ParallelDims.for_world`).

`tfpar.launch --workers=3 --min_workers=2 --lost_after=1`: a DTensor mesh
`--data_parallel=3 --tensor_parallel=2` over 3 workers × 2 logical CPUs (batch 64: 22/21/21
per replica), Adam, a checkpoint every 10 steps; worker slot 2 SIGKILLs itself at a random
step between 11 and 19. The survivors (2 workers, 4 devices) cannot hold dp=3 × tp=2: they
keep tp=2 and shrink to dp=2, and resume from the step-10 checkpoint resharded onto that
mesh. The checkpoint directory as the loss left it (copied when the launcher says the slot
is lost, before the survivors start) is resumed by the uninterrupted run on the new layout:
one process, dp=2 × tp=2 over 4 logical CPUs. The survivors' losses must equal its losses
within 1e-5 (relative; Adam) and their final weights within 1e-5, and the same run from
step 0 on the new layout (never interrupted) within 1e-5; both ranks resumed at step 10,
ran the same steps with the same losses, and hold the same weights and optimizer state
(Adam's step count and slots), to the bit.

3D: dp=1 × tp=2 × pp=2 over 2 workers × 2 logical CPUs (SGD) loses worker 1 between steps
6 and 9; the survivor's 2 devices cannot hold tp × pp = 4, so it keeps tp=2 and drops the
pipeline, resuming the two stages' checkpoint on one mesh: the same comparisons within
1e-6.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import threading

import numpy as np

from subproc import ROOT, in_background, popen, rank_line, run
from subproc import max_diff as _gap, saved_arrays as _arrays
from tfpar import ParallelConfig, relayout
from tfpar.dims import ParallelDims

CHILD = os.path.join(ROOT, "tests", "train_configs_child.py")
MESH = {"model": "mlp", "optimizer": "adam", "tensor_parallel": 2, "cpu_devices": 2,
        "steps": 20, "steps_per_epoch": 10, "checkpoint_every": 10, "verbose": 0,
        "collective_timeout_s": 60, "checkpoint_async": False}


def _shrink(tmp_path, workers, cfg, reference, kill_range):
    """Launches `cfg` on `workers` workers (--min_workers one fewer); the last slot kills
    itself at a random step of `kill_range`; when the launcher says it is lost, the
    checkpoint directory is copied and `reference` (one process) resumes from the copy
    beside the survivors, then trains the same from step 0 without a checkpoint. Returns
    (launcher output, survivors' result lines, the reference's two results, context for
    messages, kill step, seed)."""
    seed = random.randrange(1 << 30)
    kill_step = random.Random(seed).randrange(*kill_range)
    ckpt, copy = tmp_path / "ckpt", tmp_path / "at_loss"
    cfg = {**cfg, "checkpoint_dir": str(ckpt)}
    references = [{**reference, "checkpoint_dir": str(copy)}, reference]
    lost = workers - 1
    cmd = [sys.executable, "-m", "tfpar.launch", f"--workers={workers}",
           f"--min_workers={lost}", "--max_restarts=1", "--lost_after=1", "--grace=30",
           "--timeout=400", "--", sys.executable, CHILD, json.dumps([cfg]),
           str(tmp_path / "elastic")]
    proc = popen(cmd, env={"TFPAR_INJECT_FAULTS": f"{lost}:{kill_step}"}, text=True,
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, reference_run = [], []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if f"worker slot {lost} is lost" in line:  # all stopped, none restarted yet
                shutil.copytree(ckpt, copy)
                reference_run.append(in_background(lambda: run(
                    [sys.executable, CHILD, json.dumps(references),
                     str(tmp_path / "whole")], timeout=300)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=460)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    reader.join(timeout=5)
    output = "".join(lines)
    context = f"seed {seed}, kill at step {kill_step}\n{output[-4000:]}"
    assert proc.returncode == 0, context
    assert f"world size {workers} -> {lost}" in output, context
    ranks = [rank_line(output, i) for i in range(lost)]
    out = reference_run[0].result()
    wholes = next(json.loads(line) for line in reversed(out.stdout.splitlines())
                  if line.startswith("[{"))
    return output, ranks, wholes, context, kill_step, seed


def test_a_mesh_job_losing_a_worker_shrinks_its_data_parallel_degree(tmp_path,
                                                                      report_measured):
    output, ranks, (whole, scratch), context, kill_step, seed = _shrink(
        tmp_path, 3, {**MESH, "data_parallel": 3},
        {**MESH, "data_parallel": 2, "cpu_devices": 4}, (11, 20))
    assert ("tfpar: elastic: data_parallel × tensor_parallel × pipeline_stages 3×2×1 -> "
            "2×2×1 for the 4 devices of 2 worker(s)") in output, context
    for rank in ranks:
        assert rank["mesh"] == {"data_parallel": 2, "tensor_parallel": 2}, context
        assert (rank["workers"], rank["resumed_from_step"], rank["steps"]) == (2, 10, 10), \
            context
    assert ranks[0]["loss_history"] == ranks[1]["loss_history"], context
    assert (whole["resumed_from_step"], whole["steps"]) == (10, 10)
    assert whole["mesh"] == ranks[0]["mesh"]
    losses, same = np.array(ranks[0]["loss_history"]), np.array(whole["loss_history"])
    gaps = np.abs(losses - same) / same
    # And the state was the one the job had: the run from step 0 on this layout, never
    # interrupted, has the same losses (float re-association of another layout only).
    drift = np.abs(losses - scratch["loss_history"][10:]) / losses
    weights = [_arrays(tmp_path / f"elastic.0.worker{i}.npz") for i in range(2)]
    slots = [_arrays(tmp_path / f"elastic.0.worker{i}.optimizer.npz") for i in range(2)]
    gap = _gap(weights[0], _arrays(tmp_path / "whole.0.npz"))
    report_measured(f"elastic mesh 3 -> 2 workers (dp3xtp2 -> dp2xtp2, lost at step "
                    f"{kill_step}, seed {seed}): steps 10-19 largest relative loss gap to "
                    f"the uninterrupted dp2xtp2 run from the same checkpoint {gaps.max():.1e}, "
                    f"final weights' gap {gap:.1e}; ranks' weights and Adam state "
                    f"{_gap(weights[0], weights[1]):.1e} / {_gap(slots[0], slots[1]):.1e} "
                    f"apart; vs the run from step 0 on dp2xtp2 {drift.max():.1e}")
    assert gaps.max() <= 1e-5, f"{gaps}\n{context}"
    assert drift.max() <= 1e-5, f"{drift}\n{context}"
    assert gap <= 1e-5, context
    assert _gap(weights[0], weights[1]) == 0 and _gap(slots[0], slots[1]) == 0, context
    assert int(slots[0][0]) == 20, context  # Adam's step count: 20 updates, none lost


def test_a_3d_job_losing_a_worker_drops_the_stages_that_no_longer_fit(tmp_path,
                                                                      report_measured):
    # dp1 × tp2 × pp2 over 2 workers × 2 logical CPUs; the survivor has 2 devices, where
    # tp × pp = 4 does not fit: tp=2 is kept and the pipeline goes (the checkpoint's
    # two stages load onto one mesh). SGD: 1e-6.
    sgd = {**MESH, "optimizer": "sgd", "learning_rate": 0.1, "steps": 10,
           "steps_per_epoch": 5, "checkpoint_every": 5}
    output, ranks, (whole, scratch), context, kill_step, seed = _shrink(
        tmp_path, 2, {**sgd, "data_parallel": 1, "pipeline_stages": 2, "microbatches": 2},
        {**sgd, "data_parallel": 1}, (6, 10))
    assert ("tfpar: elastic: data_parallel × tensor_parallel × pipeline_stages 1×2×2 -> "
            "1×2×1 for the 2 devices of 1 worker(s)") in output, context
    (rank,) = ranks
    assert rank["mesh"] == whole["mesh"] == {"data_parallel": 1, "tensor_parallel": 2}
    assert (rank["resumed_from_step"], rank["steps"]) == (5, 5), context
    assert (whole["resumed_from_step"], whole["steps"]) == (5, 5)
    losses, same = np.array(rank["loss_history"]), np.array(whole["loss_history"])
    gaps = np.abs(losses - same) / same
    drift = np.abs(losses - scratch["loss_history"][5:]) / losses
    gap = _gap(_arrays(tmp_path / "elastic.0.worker0.npz"), _arrays(tmp_path / "whole.0.npz"))
    report_measured(f"elastic 3D 2 -> 1 workers (dp1xtp2xpp2 -> dp1xtp2, lost at step "
                    f"{kill_step}, seed {seed}): steps 5-9 largest relative loss gap to the "
                    f"uninterrupted tp2 run from the same checkpoint {gaps.max():.1e}, final "
                    f"weights' gap {gap:.1e}; vs the run from step 0 on tp2 {drift.max():.1e}")
    assert gaps.max() <= 1e-6, f"{gaps}\n{context}"
    assert drift.max() <= 1e-6, f"{drift}\n{context}"
    assert gap <= 1e-6, context


def _cluster(workers):
    return {"TFPAR_ELASTIC": "1", "TF_CONFIG": json.dumps(
        {"cluster": {"worker": [f"localhost:{2000 + i}" for i in range(workers)]},
         "task": {"type": "worker", "index": 0}})}


def test_the_rule_keeps_the_model_parallel_degrees_where_they_fit():
    # dp2 x tp2 x pp2 written for 8 devices: on 4 (one process) tp x pp still fits.
    first = [(d.dp, d.tp, d.pp) for d in ParallelDims(dp=2, tp=2, pp=2).for_world(4, 1)]
    assert first[0] == (1, 2, 2)
    # On 6 devices of 3 processes tp x pp = 4 does not divide: the largest that does,
    # the tensor degree first (3x2x1), then 3x1x2.
    assert [(d.dp, d.tp, d.pp) for d in ParallelDims(dp=2, tp=2, pp=2).for_world(6, 3)][:2] \
        == [(3, 2, 1), (3, 1, 2)]
    # Every stage's mesh must split over the processes: 2 devices of 2 processes with tp=2
    # and pp=2 leave no layout with pp=2 (a stage of 1 device on 2 processes).
    assert all(d.pp == 1 for d in ParallelDims(dp=1, tp=2, pp=2).for_world(2, 2))


def test_only_an_elastic_launch_re_lays_out_and_one_line_says_so():
    config = ParallelConfig(model="mlp", tensor_parallel=2, data_parallel=3, cpu_devices=2)
    said = []
    new = relayout.for_cluster(config, _cluster(2), say=said.append)
    assert (new.data_parallel, new.tensor_parallel, new.pipeline_stages) == (2, 2, 1)
    assert said == ["tfpar: elastic: data_parallel × tensor_parallel × pipeline_stages "
                    "3×2×1 -> 2×2×1 for the 4 devices of 2 worker(s) (tensor × pipeline "
                    "degrees kept where they fit; the checkpoint reshards onto the new "
                    "layout)"]
    # Not elastic: the trainer's own refusal stands; degrees that fit: unchanged.
    assert relayout.for_cluster(config, {**_cluster(2), "TFPAR_ELASTIC": "0"}) is config
    assert relayout.for_cluster(config, _cluster(3), say=said.append) is config
    assert len(said) == 1
