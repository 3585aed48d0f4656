"""`--sequence_parallel` with the mesh's codecs (`tfpar.layout.reduction`): the transformer
on a 2×2 mesh, each codec against the uncompressed sequence-parallel run on the same seed.

The compressed step forms each replica's gradient inside `tf.vectorized_map`, where the
sequence layouts' relayouts are vectorized by tfpar (`tfpar.layout.activations.per_replica`;
TF 2.21's own fallback, a `while_loop`, crashed the process). Top-k at ratio 1 sends every
entry: equal to the uncompressed run up to the sum's re-association, which checks the
vectorized relayouts and their gradients; the others at their defaults end within
tests/test_layout_mesh.py's band, each with its bytes in the metrics JSON. Two children at
once (three runs, two runs). fp16 is not run here: an elementwise cast of the per-replica
gradient that top-k at ratio 1 already holds exact under these layouts, run on the 2×2 mesh
by tests/test_layout_mesh.py (each run here costs a DTensor expansion of the whole step).
Both children run with grappler off (tests/graph_optimizer.py), the uncompressed run too;
a third, with TensorFlow's default optimizer (grappler on, as users run; no other file
trains a codec with sequence parallelism with it), runs the uncompressed run and top-k at
ratio 1, 4 steps: equal, as above.
"""

import pytest

import subproc
from graph_optimizer import OFF as GRAPPLER_OFF
from test_layout_compose import train_configs
from test_layout_mesh import DEFAULTS_BAND
from test_train import max_diff, weights

STEPS = 10
SEQ = {"model": "transformer", "steps": STEPS, "steps_per_epoch": STEPS, "verbose": 0,
       "global_batch_size": 32, "optimizer": "adam", "learning_rate": 1e-3,
       "tensor_parallel": 2, "data_parallel": 2, "cpu_devices": 4,
       "sequence_parallel": True, "model_depth": 1,  # one block: each run traces ~1 min
       "adam_warmup_steps": 3}  # Adam in front of top-k and PowerSGD: 3 exact steps, 7 not
# (the uncompressed run first; run i's weights are `<child>.<i>`; top-k at ratio 1 with
# Adam behind it, the codec's own limit: Adam in front keeps each replica's `v`)
FIRST = [{}, {"compression": "topk", "topk_ratio": 1.0, "compress_adam_step": False},
         {"compression": "int8"}]
SECOND = [{"compression": "powersgd"}, {"compression": "topk"}]
# (lowbit and threshold share the reduction path and are not traced again here: each run
# costs a DTensor expansion of the whole step)
LOSSY = ["int8", "powersgd", "topk"]


# With grappler on (TensorFlow's default): the uncompressed run and top-k at ratio 1.
DEFAULT_STEPS = {"steps": 4, "steps_per_epoch": 4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seq_codecs")
    first, second, default = subproc.run_concurrently([
        lambda: train_configs(str(folder / "a"), [{**SEQ, **r} for r in FIRST],
                              env=GRAPPLER_OFF),
        lambda: train_configs(str(folder / "b"), [{**SEQ, **r} for r in SECOND],
                              env=GRAPPLER_OFF),
        lambda: train_configs(str(folder / "c"), [{**SEQ, **r, **DEFAULT_STEPS}
                                                  for r in FIRST[:2]])])
    results = first[None] + second[None]
    # each child with the optimizer its test asked for
    assert {r["grappler"] for r in results} == {"off"}
    assert {r["grappler"] for r in default[None]} == {"default"}
    by_codec = {r["compression"]: result for r, result in zip(FIRST[2:] + SECOND, results[2:])}
    return {"folder": folder, "none": results[0], "topk@1": results[1], **by_codec,
            "default": default[None]}


def _loss_gap(a, b):
    return max(abs(x - y) for x, y in zip(a["loss_history"], b["loss_history"]))


@pytest.mark.parametrize("optimizer", ["grappler off", "grappler on"])
def test_topk_at_ratio_one_equals_the_uncompressed_sequence_parallel_run(
        runs, report_measured, optimizer):
    # Grappler on (TensorFlow's default): its fusions and its dependency optimizer (which
    # edits the control edges around the collectives) meet the vectorized relayouts and
    # the codec's reduction.
    if optimizer == "grappler off":
        (plain, full), child, steps = (runs["none"], runs["topk@1"]), "a", STEPS
    else:
        (plain, full), child, steps = runs["default"], "c", DEFAULT_STEPS["steps"]
    assert "comm" not in plain  # DTensor's own sum over `batch`: no codec
    assert full["comm"]["bytes_on_wire_per_step"] > 0  # the reduction path ran
    assert len(full["loss_history"]) == len(plain["loss_history"]) == steps
    folder = runs["folder"]
    diff = max_diff(weights(str(folder / f"{child}.0")), weights(str(folder / f"{child}.1")))
    gap = _loss_gap(full, plain)
    assert diff < 1e-5 and gap < 1e-5, (diff, gap)
    report_measured(f"--sequence_parallel transformer 2x2, {optimizer}, {steps} Adam steps, "
                    f"top-k at ratio 1 vs uncompressed: weights {diff:.1e}, losses {gap:.1e}")


def test_each_codec_ends_near_the_uncompressed_sequence_parallel_run(runs, report_measured):
    plain = runs["none"]
    fp32 = runs["int8"]["comm"]["bytes_uncompressed_per_step"]
    measured = []
    for codec in LOSSY:
        result = runs[codec]
        assert result["mesh"] == {"data_parallel": 2, "tensor_parallel": 2}, codec
        gap = result["final_loss"] / plain["final_loss"] - 1
        comm = result["comm"]
        measured.append(f"{codec} {gap:+.2%} ({comm['bytes_on_wire_per_step']} B)")
        assert abs(gap) < DEFAULTS_BAND.get(codec, 0.02), (codec, gap)
        assert comm["bytes_uncompressed_per_step"] == fp32, (codec, comm)
        assert 0 < comm["bytes_on_wire_per_step"] < fp32, (codec, comm)
        assert _loss_gap(result, plain) > 1e-5, codec  # it ran: the losses moved
    report_measured(f"--sequence_parallel transformer 2x2, {STEPS} Adam steps, final loss "
                    f"vs uncompressed (fp32 {fp32} B/step): " + ", ".join(measured))
