"""ZeRO 1/2 with every codec but `auto` (`--zero_stage=1|2 --compression=lowbit|topk|
threshold|powersgd`, `tfpar.zero.sharded`, `tfpar.zero.piece_codecs`).

The piece codecs are checked without a strategy. Training runs one child
(tests/zero_child.py, 2 replicas, 5 steps, same seed and data) beside the fp16 child
(tests/zero12_codecs_child.py): each codec's weights against uncompressed ZeRO-2 and
against data parallelism with the same codec; where the codec is exact at its limit, to
float rounding (top-k at ratio 1: bit-equal; PowerSGD at full rank, ZeRO-1); lowbit with
the optimizer state offloaded, bit-equal to lowbit on the devices; its bytes
per step from the metrics JSON's `comm` block; a trainer resume of lowbit (ZeRO's own
residual) and PowerSGD (the aggregator's residuals and Q) equal to the uninterrupted run;
under fp16 loss scaling a forced overflow skipped by every replica with the codec's state
untouched, and a `tfpar.state` save/load equal to the saved model for each codec.
"""

import json
import os
import sys

import numpy as np
import pytest

from subproc import ROOT, last_json_line, run, run_concurrently
from test_zero import ADAM, BASE, MOMENTUM, max_diff, weights

CHILD = os.path.join(ROOT, "tests", "zero_child.py")
FP16_CHILD = os.path.join(ROOT, "tests", "zero12_codecs_child.py")
CODECS = ("lowbit", "topk", "threshold", "powersgd")
# Max |w - w_ref| after 5 steps, mlp with momentum (lr 0.05) / transformer with Adam
# (lr 1e-3), 2 replicas. Measured 2026-12-05 (one run), against uncompressed ZeRO-2: lowbit
# 3.1e-3 / 5.2e-3, top-k 2.9e-3 / 5.3e-3, threshold 2.3e-5, PowerSGD 1.6e-3 / 5.9e-3;
# against data parallelism's lowbit 2.7e-3, top-k 2.5e-3; about 3-9x margin.
TOLERANCE = {"lowbit": 2e-2, "topk": 2e-2, "threshold": 2e-4, "powersgd": 3e-2}
# Final loss after 5 steps within 5 % of the reference's; measured: the transformer with
# Adam and top-k (no Adam in front of the codec on ZeRO) +2.5 %, every other within 0.9 %.
LOSS_BAND = 0.05
# ZeRO's top-k has no union of the replicas' indices (the setting does nothing there, one
# warning line says so; the other codecs ignore it): the runs say it.
NO_UNION = {"topk_union": False}
# With Adam these take Adam in front by default (tests/test_zero12_adam_front.py); the
# transformer runs here keep Adam behind them (`compress_adam_step=False`), and the fp16
# child runs both.
ADAM_FRONT = ("lowbit", "topk", "powersgd")


def test_piece_codecs_code_each_tensor_part_as_the_codecs_do():
    import tensorflow as tf

    from tfpar.compression import codecs, lowbit
    from tfpar.zero import piece_codecs

    sizes, n = [700, 10, 300], 2  # a bias between two kernels; piece 505, padding 0
    piece = -(-sum(sizes) // n)
    flat = tf.random.stateless_normal([n * piece], [3, 4]) * tf.concat(
        [tf.fill([700], 1.0), tf.fill([10], 1e-3), tf.fill([300 + n * piece - 1010], 10.0)], 0)
    rows = tf.reshape(flat, [n, piece])
    low = piece_codecs.LowBitPieces(sizes, n, piece, bits=3)
    sent = low.encode(rows)
    assert sent.dtype == tf.int32 and sent.shape == (n, low.message_words())
    own = low.decode_own(sent)
    # Piece 1 holds the end of the first kernel, the bias and the second kernel: the
    # bias has its own scale (decoded to within its own magnitude / 3), as lowbit's
    # encode of the bias alone gives.
    bias = slice(700 - piece, 710 - piece)
    words, scales = lowbit.encode(rows[1][bias], tf.zeros([10], tf.int32), 1, 3)
    np.testing.assert_array_equal(own[1][bias],
                                  lowbit.decode(words, scales, tf.zeros([10], tf.int32), 10, 3))
    assert float(tf.reduce_max(tf.abs(own[1][bias] - rows[1][bias]))) < 1e-3 / 2
    # Each piece's block ids where the replica id is known only when the step runs (the
    # gather from every piece's ids) are lowbit's own for that piece (blocks cut per tensor
    # part, the padding its own).
    dynamic = tf.function(low._ids, input_signature=[tf.TensorSpec([], tf.int32)])
    for r in range(n):
        np.testing.assert_array_equal(dynamic(tf.constant(r)),
                                      lowbit.block_ids(low.lengths[r], 256))
    # An owner decodes what every replica sent it as that replica decoded its own.
    for rank in range(n):
        received = tf.stack([sent[rank], sent[rank]])
        np.testing.assert_array_equal(low.decode(received, rank)[0], own[rank])

    top = piece_codecs.TopKPieces(sizes, n, piece, ratio=0.1, dense_below=16)
    sent = top.encode(rows, 0)
    decoded = top.decode_own(sent)
    for r in range(n):  # each part: its largest tenth exactly, the small bias whole
        for offset, length, k in top.parts[r]:
            part, got = rows[r][offset:offset + length], decoded[r][offset:offset + length]
            values, _ = codecs.topk(part, k)
            assert int(tf.math.count_nonzero(got)) == k
            np.testing.assert_array_equal(np.sort(got[got != 0]), np.sort(values))
    assert top.message_words() == 2 * max(sum(k for _, _, k in p) for p in top.parts)
    # A part over 65 536 entries takes top-k's sampled threshold, seeded by the
    # optimizer's step (a Keras variable): still exactly its largest entries here.
    import keras
    big, piece_big = [300000, 50], 150025
    rows_big = tf.reshape(tf.random.stateless_normal([2 * piece_big], [5, 6]), [2, -1])
    top_big = piece_codecs.TopKPieces(big, 2, piece_big, ratio=0.01, dense_below=16)
    decoded = top_big.decode_own(top_big.encode(rows_big, keras.Variable(3, dtype="int64")))
    for r in range(2):
        for offset, length, k in top_big.parts[r]:
            got = decoded[r][offset:offset + length]
            values, _ = codecs.topk(rows_big[r][offset:offset + length], k)
            np.testing.assert_array_equal(np.sort(got[got != 0]), np.sort(values))
    full = piece_codecs.TopKPieces(sizes, n, piece, ratio=1.0, dense_below=0)
    np.testing.assert_array_equal(full.decode_own(full.encode(rows, 0)), rows)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero12")
    where = {**BASE, "strategy": "mirrored", "cpu_devices": 2}
    mlp = {**where, "model": "mlp", **MOMENTUM}
    tr = {**where, "model": "transformer", "model_depth": 1, **ADAM}
    cases = [{"name": "mlp-z2-none", **mlp, "zero_stage": 2},
             {"name": "mlp-z2-topk1", **mlp, "zero_stage": 2, "compression": "topk",
              "topk_ratio": 1.0, **NO_UNION},
             # Rank 32 on a batch of 8: each kernel's summed gradient has rank <= 8, well
             # inside the factors (at 32 examples, rank 32 itself, the QR rounded the
             # smallest singular values: 5.9e-5), and the 256 x 256 kernel still travels
             # as factors.
             {"name": "mlp-z2-none-b8", **mlp, "zero_stage": 2, "global_batch_size": 8},
             {"name": "mlp-z1-powersgd-full", **mlp, "zero_stage": 1,
              "compression": "powersgd", "powersgd_rank": 32, "global_batch_size": 8}]
    for codec in CODECS:
        ckpt = ({"checkpoint_dir": str(folder / f"ck-{codec}")}
                if codec in ("lowbit", "powersgd") else {})
        cases += [{"name": f"mlp-z2-{codec}", **mlp, "zero_stage": 2, "compression": codec,
                   **ckpt, **NO_UNION},
                  {"name": f"mlp-dp-{codec}", **mlp, "compression": codec}]
    # Offload moves only the owner's update to the host: bit-equal to lowbit on the devices
    # (top-k takes the same path).
    cases += [{"name": "mlp-z2-lowbit-offload", **mlp, "zero_stage": 2,
               "compression": "lowbit", "offload": "optimizer"}]
    # mlp-z2-lowbit and -powersgd saved their 5 steps: "resumed" goes on to 10.
    for codec in ("lowbit", "powersgd"):
        long = {**mlp, "zero_stage": 2, "compression": codec, "steps": 10}
        cases += [{"name": f"whole-{codec}", **long},
                  {"name": f"resumed-{codec}", **long,
                   "checkpoint_dir": str(folder / f"ck-{codec}")}]
    # Adam with an embedding (IndexedSlices: densified by the aggregators, its squared
    # slices reduce-scattered in bf16 beside the piece codecs).
    cases += [{"name": "tr-z2-none", **tr, "zero_stage": 2}]
    cases += [{"name": f"tr-z2-{codec}", **tr, "zero_stage": 2, "compression": codec,
               "compress_adam_step": False, **NO_UNION} for codec in ADAM_FRONT]
    prefix = str(folder / "w")
    out, fp16_out = run_concurrently([
        lambda: run([sys.executable, CHILD, json.dumps(cases), prefix], timeout=900),
        lambda: run([sys.executable, FP16_CHILD], timeout=600)])
    return prefix, last_json_line(out.stdout), last_json_line(fp16_out.stdout)


def test_zero12_codecs_train_as_uncompressed_zero_and_as_data_parallel(trained,
                                                                      report_measured):
    prefix, results, _ = trained

    def diff(a, b):
        return max_diff(weights(f"{prefix}.{a}.npz"), weights(f"{prefix}.{b}.npz"))

    # Exact at the limit: top-k sending every entry sums as the fp32 reduce-scatter does,
    # bit for bit; PowerSGD above the gradients' rank (ZeRO-1) to float rounding, its
    # factors on the wire.
    assert diff("mlp-z2-topk1", "mlp-z2-none") == 0
    d = diff("mlp-z1-powersgd-full", "mlp-z2-none-b8")
    report_measured(f"zero12 codecs: PowerSGD full rank vs uncompressed ZeRO, max |dw| = {d:.2e}")
    # Measured 4.8e-8 (2026-12-05, one run): fp32 rounding of the factors' products.
    assert d <= 2e-7, d
    assert (results["mlp-z1-powersgd-full"]["comm"]["bytes_on_wire_per_step"]
            < 0.6 * results["mlp-z2-none-b8"]["comm"]["bytes_on_wire_per_step"])
    for name, ref in [(f"mlp-z2-{c}", "mlp-z2-none") for c in CODECS] + [
            (f"mlp-z2-{c}", f"mlp-dp-{c}") for c in CODECS] + [
            (f"tr-z2-{c}", "tr-z2-none") for c in ("lowbit", "topk", "powersgd")]:
        codec = name.split("-")[2]
        d = diff(name, ref)
        loss, ref_loss = results[name]["final_loss"], results[ref]["final_loss"]
        report_measured(f"zero12 codecs: {name} vs {ref}, max |dw| after 5 steps = {d:.2e}, "
                        f"final loss {loss:.4f} vs {ref_loss:.4f}")
        assert d <= TOLERANCE[codec], (name, ref, d)
        assert abs(loss - ref_loss) <= LOSS_BAND * abs(ref_loss), (name, loss, ref_loss)
        if ref.endswith("none"):
            assert d > 0, name  # the codec ran: its error is in the weights
    assert diff("mlp-z2-lowbit-offload", "mlp-z2-lowbit") == 0
    assert results["mlp-z2-lowbit-offload"]["offload"]["host_state_bytes"] > 0
    # Threshold and PowerSGD go through data parallelism's aggregator, the update on flat
    # pieces: the same sums, so the weights agree to float rounding.
    for codec in ("threshold", "powersgd"):
        d = diff(f"mlp-z2-{codec}", f"mlp-dp-{codec}")
        assert d <= 1e-6, (codec, d)


def test_zero12_codecs_bytes_per_step(trained, report_measured):
    _, results, _ = trained
    n = 2
    none = results["mlp-z2-none"]["comm"]["bytes_on_wire_per_step"]
    piece = none // (4 * (n + 1))  # n fp32 gradient pieces into the all-to-all, one gathered
    assert none == 4 * (n + 1) * piece
    gradient = 4 * n * piece

    def sent(name):  # the gradient's bytes: the weight gather (fp32) stays
        return results[name]["comm"]["bytes_on_wire_per_step"] - 4 * piece

    for name in [f"mlp-z2-{c}" for c in CODECS] + ["mlp-z2-topk1"]:
        report_measured(f"zero12 codecs: {name} {sent(name)} gradient B/step vs {gradient} "
                        f"fp32 ({gradient / sent(name):.2f}x fewer; mlp, 2 replicas)")
    # lowbit: 3 bits and a scale per 256 entries of a tensor's part, ~10x fewer.
    assert gradient / 10.5 < sent("mlp-z2-lowbit") <= gradient / 10, sent("mlp-z2-lowbit")
    # top-k at 25 % of each part: a value and an index each, about half of fp32 (the
    # biases, at most --topk_dense_below entries, go whole as pairs).
    assert gradient * 0.5 <= sent("mlp-z2-topk") < gradient * 0.52, sent("mlp-z2-topk")
    # At ratio 1 every entry goes with its index: twice fp32 (exact, not a saving).
    assert sent("mlp-z2-topk1") == 2 * gradient
    # PowerSGD's factors and the vectors sent whole, all-reduced (every replica the sum).
    assert sent("mlp-z2-powersgd") < 0.6 * gradient, sent("mlp-z2-powersgd")
    # Threshold's pairs are data dependent: more than fp32 on this model at 1e-4 (nearly
    # every entry passes), all-gathered; the count is what the step measured.
    assert sent("mlp-z2-threshold") > 0
    for codec in CODECS:
        assert results[f"mlp-z2-{codec}"]["optimizer_state_bytes_per_device"] == results[
            "mlp-z2-none"]["optimizer_state_bytes_per_device"]  # the slots stay sharded


def test_zero12_codecs_resume_as_the_uninterrupted_run(trained):
    prefix, results, _ = trained
    for codec in ("lowbit", "powersgd"):
        assert results[f"resumed-{codec}"]["resumed_from_step"] == 5
        assert max_diff(weights(f"{prefix}.resumed-{codec}.npz"),
                        weights(f"{prefix}.whole-{codec}.npz")) == 0, codec
        np.testing.assert_array_equal(results[f"resumed-{codec}"]["loss_history"],
                                      results[f"whole-{codec}"]["loss_history"][5:])


def test_zero12_codecs_skip_an_fp16_overflow_on_every_replica(trained, report_measured):
    skips = trained[2]["skips"]
    assert sorted(skips) == sorted(CODECS + tuple(f"{c}-front" for c in ADAM_FRONT))
    for name, r in skips.items():
        # Something to move: every replica's residual (PowerSGD: and its Qs; Adam in front:
        # and every replica's moments, the step counter).
        assert r["codec_arrays"] >= 2 and r["codec_largest"] > 0, (name, r)
        if not name.endswith("-front"):  # in front, ZeRO's slots stay unused (zero)
            assert r["slots_largest"] > 0, (name, r)
        # One infinite input on replica 0: no weight, slot piece, residual or Q moved on
        # either replica, the step count stays, the scale halves.
        assert not np.isfinite(r["skipped_loss"]), (name, r)
        assert r["weights_moved"] == r["slots_moved"] == r["codec_moved"] == 0, (name, r)
        assert r["iterations"][1] == r["iterations"][0] == 2, (name, r)
        assert r["scales"][1] == r["scales"][0] / 2, (name, r)
        assert r["weights_moved_next"] > 0 and r["codec_moved_next"] > 0, (name, r)
        assert all(np.isfinite(r["losses"])), (name, r)
        # Saved with tfpar.state and loaded into a fresh model: the same state, the same
        # next step.
        assert r["loaded_scale"] == r["scales"][1], (name, r)
        assert r["loaded_diff"] == 0 and r["resumed_next_diff"] == 0, (name, r)
    report_measured("zero12 codecs: fp16 overflow skipped with the codec state untouched: "
                    + ", ".join(sorted(skips)))


def test_zero12_aggregator_step_decides_finiteness_with_no_extra_all_reduce(trained):
    # With Adam behind PowerSGD: ZeRO's one scalar all-reduce before the aggregator (every
    # replica's gradients finite?) and the whole sum's check on every replica: as many
    # all-reduces as data parallelism's PowerSGD step (Adam in front there: its exact
    # warm-up's all-reduce in place of the scalar; a second scalar all-reduce over the
    # pieces made ZeRO's 8 against 6, one per replica's traced body, before 2026-12-05).
    counts = trained[2]["collectives"]
    assert counts["zero2"]["CollectiveReduceV2"] == counts["dp"]["CollectiveReduceV2"], counts
    assert counts["zero2"]["CollectiveGatherV2"] > 0  # the weights' gather: ZeRO's step
    # Adam in front: data parallelism's collectives, no more (no scalar all-reduce before
    # the aggregator under --on_nan=stop), and no weight gather (every replica applies the
    # summed steps).
    assert counts["zero2-front"] == counts["dp"], counts
    assert "CollectiveGatherV2" not in counts["zero2-front"], counts


@pytest.mark.parametrize("settings, setting", [
    ({"compression": "auto"}, "compression"),
    ({"compression": "topk", "topk_warmup_steps": 10, "compress_adam_step": False,
      **NO_UNION}, "topk_warmup_steps")])
def test_zero12_refuses_what_is_not_built(settings, setting):
    from tfpar import ParallelConfig
    from tfpar.errors import ConfigError
    with pytest.raises(ConfigError, match=f"^{setting}="):
        ParallelConfig(zero_stage=2, **settings)


def test_zero12_topk_union_is_one_line_and_the_default_still_runs(caplog):
    # The union is data parallelism's: on ZeRO 1/2 it does nothing, which one warning line
    # says; the default (--topk_union) is not refused, so `--zero_stage=2
    # --compression=topk` runs as written, and the planner offers that layout.
    import keras

    from tfpar import ParallelConfig
    from tfpar.plan import commands, cost, planner
    from tfpar.zero import sharded
    assert ParallelConfig(zero_stage=2, compression="topk").topk_union is True
    with caplog.at_level("WARNING"):
        sharded.wrap_optimizer(keras.optimizers.SGD(), 2, codec="topk",
                               codec_options={"union": True})
        sharded.wrap_optimizer(keras.optimizers.SGD(), 2, codec="topk",
                               codec_options={"union": False})
        sharded.wrap_optimizer(keras.optimizers.SGD(), 2, codec="lowbit",
                               codec_options={"union": True})
    lines = [r.getMessage() for r in caplog.records if "--topk_union" in r.getMessage()]
    assert lines == [sharded.TOPK_UNION_LINE], lines
    assert lines[0].startswith("--topk_union has no effect with --zero_stage=1|2")
    hw = cost.Hardware(devices=2, memory_bytes=1e9, flops=1e9, intra_bandwidth=1e9,
                       inter_bandwidth=1e9)
    request = planner.Request(model="mlp", global_batch_size=32, zero=(0, 2))
    assert commands.runnable(cost.Candidate(2, 1, 1, 1, "topk", 1, False, 2), hw, request) \
        is None


def test_zero12_tells_adam_behind_a_codec_that_failed_the_quality_suite(caplog):
    import keras

    from tfpar.zero import sharded
    with caplog.at_level("WARNING"):
        sharded.wrap_optimizer(keras.optimizers.Adam(), 2, codec="lowbit")
        sharded.wrap_optimizer(keras.optimizers.SGD(momentum=0.9), 2, codec="lowbit")
        sharded.wrap_optimizer(keras.optimizers.Adam(), 2, codec="int8")
    lines = [r.getMessage() for r in caplog.records if "--zero_stage=1|2" in r.getMessage()]
    assert len(lines) == 1 and "--compression=lowbit with Adam" in lines[0], lines
