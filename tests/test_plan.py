"""The planner's cost model against hand-computed cases, and its refusals."""

import dataclasses
import json
import sys

import pytest

from subproc import run
from tfpar import ParallelConfig
from tfpar.errors import ConfigError, TfparError
from tfpar.plan import calibration, commands, cost, planner, profile

PROFILE = cost.Profile(name="toy", params=1_000_000, flops_per_example=2e6,
                       activation_bytes_per_example=1e4, boundary_bytes_per_example=1e3,
                       blocks=4, tp_syncs_per_block=4, max_tensor_parallel=4,
                       matrix_shapes=((1000, 1000),))
HW = cost.Hardware(devices=4, memory_bytes=1e9, flops=1e12, intra_bandwidth=1e9,
                   inter_bandwidth=1e8, latency=0.0, action_overhead=0.0)


def test_ring_allreduce_time():
    # 2(n-1)/n * S / B: 4 peers, 100 MB at 1 GB/s -> 150 ms, plus 6 latencies
    assert cost.ring_allreduce_seconds(1e8, 4, 1e9) == pytest.approx(0.15)
    assert cost.ring_allreduce_seconds(1e8, 4, 1e9, latency=1e-3) == pytest.approx(0.156)
    assert cost.ring_allreduce_seconds(1e8, 1, 1e9) == 0.0


def test_bubble_formula():
    assert cost.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert cost.bubble_fraction(2, 4, virtual=2) == pytest.approx(1 / 9)


def test_memory_formula_adam_and_1f1b_stash():
    c = cost.Candidate(data=1, tensor=1, pipeline=2, microbatches=8, compression="none")
    # 16 B/param over half the params + activations of 2 (=K) micro-batches of 64/8 examples
    # over half the layers.
    expected = 16 * 500_000 + 1e4 / 2 * (64 / 8) * 2
    assert cost.memory_bytes(PROFILE, c, 64, "adam", "1f1b") == pytest.approx(expected)
    gpipe = 16 * 500_000 + 1e4 / 2 * (64 / 8) * 8
    assert cost.memory_bytes(PROFILE, c, 64, "adam", "gpipe") == pytest.approx(gpipe)


def test_step_time_data_parallel():
    c = cost.Candidate(data=4, tensor=1, pipeline=1, microbatches=1, compression="none")
    seconds, parts = cost.step_seconds(PROFILE, HW, c, 64)
    assert parts["compute"] == pytest.approx(3 * 2e6 * 16 / 1e12)
    assert parts["data_parallel"] == pytest.approx(1.5 * 4e6 / 1e9)
    assert seconds == pytest.approx(parts["compute"] + parts["data_parallel"])


def test_step_time_pipeline_bubble_matches_theory():
    c = cost.Candidate(data=1, tensor=1, pipeline=4, microbatches=8, compression="none")
    hw = dataclasses.replace(HW, latency=0.0, action_overhead=0.0, intra_bandwidth=1e30)
    _, parts = cost.step_seconds(PROFILE, hw, c, 64)
    share = parts["bubble"] / (parts["bubble"] + parts["compute"])
    assert share == pytest.approx(cost.bubble_fraction(4, 8))
    # Interleaving: the idle slots shrink by V.
    v2 = dataclasses.replace(c, virtual=2)
    _, parts = cost.step_seconds(PROFILE, hw, v2, 64)
    assert parts["bubble"] / (parts["bubble"] + parts["compute"]) == pytest.approx(
        cost.bubble_fraction(4, 8, 2))


def test_uneven_stages_cost_the_largest():
    # 4 blocks on 3 stages: the slowest stage runs 2 blocks (half the model), not 4/3.
    c = cost.Candidate(data=1, tensor=1, pipeline=3, microbatches=3, compression="none")
    _, parts = cost.step_seconds(PROFILE, dataclasses.replace(HW, devices=3), c, 48)
    assert parts["compute"] == pytest.approx(3 * 2e6 * 48 / 2 / 1e12)


def test_compression_ratios():
    assert cost.compression_ratio("fp16", PROFILE) == 2.0
    assert cost.compression_ratio("topk", PROFILE, topk_ratio=0.01,
                                  union=False) == pytest.approx(50.0)
    # with the union the values grow with the replicas, up to fp32's (then sent whole)
    assert cost.compression_ratio("topk", PROFILE, topk_ratio=0.1,
                                  replicas=8) == pytest.approx(10 / 9)
    assert cost.compression_ratio("topk", PROFILE, topk_ratio=0.1, replicas=10) == 1.0
    # the default: 25 % with the union, 0.75 of fp32's bytes at 2 replicas, fp32's from 3
    assert cost.compression_ratio("topk", PROFILE, replicas=2) == pytest.approx(4 / 3)
    assert cost.compression_ratio("topk", PROFILE, replicas=3) == 1.0
    # a 30x30 matrix (<= --topk_dense_below) and 9,100 vector entries go whole: 10,000 values
    small = dataclasses.replace(PROFILE, params=1_010_000,
                                matrix_shapes=((1000, 1000), (30, 30)))
    assert cost.compression_ratio("topk", small, replicas=2) == pytest.approx(
        1_010_000 / (0.75 * 1e6 + 10_000))
    assert cost.compression_ratio("topk", small, replicas=2, dense_below=0) == pytest.approx(
        4 / 3)
    # rank 4 on a 1000x1000 matrix sends 8000 numbers; the other 0 params go raw
    assert cost.compression_ratio("powersgd", PROFILE, rank=4) == pytest.approx(1e6 / 8000)
    # without a rank: the trainer's default (16), not a rank of the cost model's own
    assert cost.compression_ratio("powersgd", PROFILE) == pytest.approx(1e6 / 32000)


def test_candidates_pair_aggregators_with_replicas_only():
    layouts = set(cost.candidates(PROFILE, HW, global_batch=64))
    assert all(c.data * c.tensor * c.pipeline == 4 for c in layouts)
    assert cost.Candidate(4, 1, 1, 1, "powersgd") in layouts
    assert cost.Candidate(2, 1, 2, 4, "topk") in layouts  # each stage aggregates its own
    compressed = {c for c in layouts if c.compression != "none"}
    assert compressed and all(c.data > 1 for c in compressed)
    assert cost.Candidate(1, 1, 4, 4, "none", recompute=True) in layouts


def _plan(model="transformer", hw=None, **changes):
    request = planner.Request.from_config(ParallelConfig(model=model), **changes)
    return planner.plan(profile.builtin_profile(model), hw, request)


def test_planner_recommends_a_layout_that_fits_and_its_command():
    hw = planner.hardware_from(devices=8, memory_gb=16, tflops=10, intra_gbps=100,
                               inter_gbps=10)
    result = _plan(hw=hw)
    best = result["recommended"]
    assert best["fits"] and best["data"] * best["tensor"] * best["pipeline"] == 8
    assert result["runnable"]["command"].startswith(
        "python -m tfpar.train --model=transformer")
    assert result["ranked"][0]["step_seconds"] <= result["ranked"][-1]["step_seconds"]
    assert {r["tensor"] for r in result["layouts"]} >= {1, 2, 4}  # tp ranked by default


def test_planner_refuses_impossible_requests():
    hw = planner.hardware_from(devices=4, memory_gb=0.0001, tflops=1, intra_gbps=1,
                               inter_gbps=1)
    with pytest.raises(TfparError, match="fits on no layout of 4 device"):
        _plan(hw=hw)
    with pytest.raises(ConfigError, match="pipeline_stages=.*at most"):
        _plan("mlp", hw, pipeline_stages=9)
    with pytest.raises(ConfigError, match="devices"):
        planner.hardware_from(devices=0, memory_gb=1, tflops=1, intra_gbps=1, inter_gbps=1)


def test_cli_json_carries_the_command():
    out = run([sys.executable, "-m", "tfpar.plan", "--model=transformer", "--devices=8",
               "--json"], timeout=120)
    result = json.loads(out.stdout)
    assert "python -m tfpar.train" in result["recommended"]["command"]


def test_step_time_fixed_costs_and_encode_per_aggregator():
    hw = dataclasses.replace(HW, step_overhead=0.01, update_seconds_per_param=1e-9,
                             encode_seconds_per_param={"topk": 1e-8, "fp16": 2e-9})
    c = cost.Candidate(data=2, tensor=1, pipeline=1, microbatches=1, compression="topk")
    seconds, parts = cost.step_seconds(PROFILE, hw, c, 64)
    # 10 ms per step + 1 ns for each of the 1e6 parameters the device updates
    assert parts["overhead"] == pytest.approx(0.011)
    # top-k at its default 25 % with the union over 2 replicas: 1e6 * 4 B * 0.25 * 3 on the
    # wire, ring over 2 at 1 GB/s, + 10 ns per parameter
    assert parts["data_parallel"] == pytest.approx(3e6 / 1e9 + 0.01)
    assert seconds == pytest.approx(sum(parts.values()))
    fp16 = dataclasses.replace(c, compression="fp16")
    assert cost.step_seconds(PROFILE, hw, fp16, 64)[1]["data_parallel"] == pytest.approx(
        2e6 / 1e9 + 0.002)
    # over 4 replicas the union's message would outgrow fp32's: every tensor whole, no
    # selection, fp32's bytes (ring over 4: 1.5 × 4e6 B)
    whole = dataclasses.replace(c, data=4)
    assert cost.step_seconds(PROFILE, hw, whole, 64)[1]["data_parallel"] == pytest.approx(
        1.5 * 4e6 / 1e9)


def test_step_time_pipeline_action_overhead():
    hw = dataclasses.replace(HW, action_overhead=1e-3, update_seconds_per_param=1e-9,
                             intra_bandwidth=1e30)
    c = cost.Candidate(data=1, tensor=1, pipeline=2, microbatches=4, compression="none")
    _, parts = cost.step_seconds(PROFILE, hw, c, 64)
    # Per stage: 3 * 2e6 FLOPs * 64 examples / 2 stages at 1 TFLOP/s, over 4 micro-batches,
    # plus a forward and a backward action of 1 ms each: a slot of 0.012 + 2 ms.
    work = 3 * 2e6 * 64 / 2 / 1e12 / 4
    assert parts["compute"] == pytest.approx(4 * work)
    assert parts["bubble"] == pytest.approx(work + 2e-3)
    assert parts["overhead"] == pytest.approx(1e-9 * 500_000 + 4 * 2e-3)
    # Logical devices sharing cores lend them to the busy stage during the bubble: only the
    # bubble's actions remain.
    shared = dataclasses.replace(hw, shared_cores=True)
    assert cost.step_seconds(PROFILE, shared, c, 64)[1]["bubble"] == pytest.approx(2e-3)
    # Without a pipeline there are no actions: a plain fit step.
    plain = cost.Candidate(data=4, tensor=1, pipeline=1, microbatches=1, compression="none")
    assert cost.step_seconds(PROFILE, hw, plain, 64)[1]["compute"] == pytest.approx(
        3 * 2e6 * 16 / 1e12)


def test_calibration_batches_avoid_the_planned_batch():
    assert calibration.calibration_batches(256, 4) == (128, 1024)
    for batch in (32, 64, 96, 256, 1000):
        small, large = calibration.calibration_batches(batch, 4)
        assert batch not in (small, large) and small % 32 == 0 and large % 32 == 0


def test_nonnegative_least_squares():
    # Unconstrained: x = (2, -1); with x >= 0 the second is dropped and the first refit.
    a = [[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]]
    b = [2.0, 1.0, 0.0]
    assert calibration.nonnegative_lstsq(a, b) == pytest.approx([1.0, 0.0])
    assert calibration.nonnegative_lstsq([[1.0, 0.0], [0.0, 1.0]], [3.0, 4.0]) == \
        pytest.approx([3.0, 4.0])


def test_fit_recovers_the_costs_that_made_the_step_times():
    truth = dataclasses.replace(
        HW, flops=2e11, shared_cores=True, step_overhead=0.02, update_seconds_per_param=3e-9,
        action_overhead=1.5e-3, latency=1e-4,
        encode_seconds_per_param={"fp16": 1e-9, "int8": 5e-9, "topk": 2e-8, "powersgd": 1e-8})
    runs = calibration.calibration_runs(PROFILE, 4, 256)
    # No top-k run on 4 devices: at its default it sends every tensor whole there.
    assert {c.compression for c, _ in runs} == {"none", "fp16", "int8", "powersgd"}
    assert "topk" in {c.compression for c, _ in calibration.calibration_runs(PROFILE, 2, 256)}
    assert all(batch != 256 for _, batch in runs)
    observations = [(c, b, cost.step_seconds(PROFILE, truth, c, b)[0]) for c, b in runs]
    start = dataclasses.replace(HW, latency=1e-4, shared_cores=True)  # links measured
    fitted, predicted = calibration.fit(PROFILE, start, observations)
    assert fitted.flops == pytest.approx(2e11, rel=1e-6)
    assert fitted.step_overhead == pytest.approx(0.02, rel=1e-6)
    assert fitted.update_seconds_per_param == pytest.approx(3e-9, rel=1e-6)
    assert fitted.action_overhead == pytest.approx(1.5e-3, rel=1e-6)
    assert fitted.encode_seconds_per_param["int8"] == pytest.approx(5e-9, rel=1e-6)
    assert predicted == pytest.approx([s for _, _, s in observations], rel=1e-6)
    # The planned batch was never run, yet is predicted exactly.
    c = cost.Candidate(2, 1, 2, 4, "none")
    assert cost.step_seconds(PROFILE, fitted, c, 256)[0] == pytest.approx(
        cost.step_seconds(PROFILE, truth, c, 256)[0], rel=1e-6)


def test_stash_matches_the_schedules():
    # The first stage's peak of forwards not yet backwarded, walked in tfpar's schedules.
    from tfpar.pipeline import schedule as sched

    for name, K, M, V in (("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
                          ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 4),
                          ("interleaved", 4, 4, 2)):
        live = peak = 0
        for action in sched.make_schedule(name, K, M, V)[0]:
            live += 1 if action.kind == "F" else -1
            peak = max(peak, live)
        c = cost.Candidate(1, 1, K, M, "none", virtual=V)
        assert cost.stashed_microbatches(c, name) == pytest.approx(peak / V), (name, K, M, V)


def test_memory_tensor_split_recompute_and_zero():
    prof = dataclasses.replace(PROFILE, replicated_activation_fraction=0.25)
    c = cost.Candidate(data=2, tensor=2, pipeline=1, microbatches=1, compression="none")
    # 16 B over half the parameters; activations: a quarter whole, three quarters halved.
    acts = 1e4 * (0.25 + 0.75 / 2) * 32
    assert cost.memory_bytes(prof, c, 64) == pytest.approx(16 * 500_000 + acts)
    # Recomputation keeps each block's input (1e3 B) and one whole block at a time.
    rc = dataclasses.replace(c, recompute=True)
    assert cost.memory_bytes(prof, rc, 64) == pytest.approx(
        16 * 500_000 + 32 * (4 * 1e3 + 1e4 / 4 * (0.25 + 0.75 / 2)))
    # ZeRO-1 splits Adam's 8 B of moments over the 2 data-parallel peers.
    z = dataclasses.replace(c, zero=1)
    assert cost.memory_bytes(prof, z, 64) == pytest.approx(12 * 500_000 + acts)
    # ZeRO-2 also splits the 4 B of gradients; ZeRO-3 the 4 B of weights too, and holds
    # one gathered block's weights (the profile's blocks / 4, halved by tensor parallelism).
    z2 = dataclasses.replace(c, zero=2)
    assert cost.memory_bytes(prof, z2, 64) == pytest.approx(10 * 500_000 + acts)
    z3 = dataclasses.replace(c, zero=3)
    gathered = 4 * prof.block_params / prof.blocks / 2
    assert cost.memory_bytes(prof, z3, 64) == pytest.approx(8 * 500_000 + gathered + acts)


def test_memory_zero12_adam_in_front_saves_nothing_over_data_parallel():
    # ZeRO-2 with Adam in front of lowbit (2 replicas, P parameters per device): whole
    # weights (4 B) and gradients (4 B: the summed steps), whole moments (8 B) beside
    # ZeRO's half slots (4 B) and lowbit's residual (4 B): 24 B, above data parallelism's
    # 16 B; Adam behind the codec (int8) keeps ZeRO-2's 4 + 2 + 4 = 10 B.
    P = PROFILE.params
    c = cost.Candidate(data=2, tensor=1, pipeline=1, microbatches=1, compression="lowbit")
    front = cost.state_bytes(PROFILE, dataclasses.replace(c, zero=2))
    assert front == pytest.approx(24 * P)
    assert front > cost.state_bytes(PROFILE, c) == pytest.approx(16 * P)
    assert cost.state_bytes(PROFILE, dataclasses.replace(c, zero=1)) == pytest.approx(front)
    behind = dataclasses.replace(c, zero=2, compression="int8")
    assert cost.state_bytes(PROFILE, behind) == pytest.approx(10 * P)


def test_collective_bandwidth_inside_and_across_machines():
    hw = cost.Hardware(devices=64, memory_bytes=1, flops=1, intra_bandwidth=300e9,
                       inter_bandwidth=25e9, devices_per_machine=8)
    assert cost.group_bandwidth(hw, 8, 1) == 300e9          # one machine: NVLink
    assert cost.group_bandwidth(hw, 8, 8) == 25e9           # one peer per machine
    assert cost.group_bandwidth(hw, 16, 2) == 100e9         # 4 per machine, 4 NICs
    assert cost.group_bandwidth(hw, 16, 1) == 200e9         # 8 per machine
    assert cost.crosses_machines(hw, 16, 1) and not cost.crosses_machines(hw, 8, 1)


def test_runnable_mirrors_the_trainers_refusals():
    one = planner.hardware_from(8, 16, 10, 100, 10)
    two = planner.hardware_from(16, 16, 10, 100, 10, devices_per_machine=8)
    req = planner.Request()
    # dp × tp × pp runs the mlp and the transformer (tfpar.layout.pipeline), with bf16,
    # fp16 and the batch-axis codecs, a codec with fp16 loss scaling too.
    assert commands.runnable(cost.Candidate(2, 2, 2, 2, "none"), one, req) is None
    assert commands.runnable(cost.Candidate(2, 2, 2, 2, "none"), one,
                             dataclasses.replace(req, model="transformer")) is None
    for precision in ("bf16", "fp16"):
        assert commands.runnable(cost.Candidate(2, 2, 2, 2, "none"), one,
                                 dataclasses.replace(req, mixed_precision=precision)) is None
    assert commands.runnable(cost.Candidate(2, 2, 2, 2, "int8"), one, req) is None
    assert commands.runnable(cost.Candidate(2, 2, 2, 2, "int8"), one,
                             dataclasses.replace(req, mixed_precision="fp16")) is None
    # The mesh compresses its batch-axis reduction with every codec, auto included.
    for codec in ("int8", "topk", "auto"):
        assert commands.runnable(cost.Candidate(4, 2, 1, 1, codec), one, req) is None
    row = {**dataclasses.asdict(cost.Candidate(4, 2, 1, 1, "int8")), "runnable": None}
    assert "--compression=int8" in commands.command(row, req, one)
    assert "compression='int8')" in "\n".join(commands.python_calls(row, req, one))
    # Recomputation runs in the trainer; ZeRO is runnable exactly when tfpar.compat
    # accepts --zero_stage (the planner asks it, it keeps no rules of its own).
    assert commands.runnable(cost.Candidate(4, 1, 2, 2, "none", recompute=True), one,
                             req) is None
    assert commands.runnable(cost.Candidate(4, 2, 1, 1, "none", recompute=True), one,
                             req) is None
    for stage in (1, 2, 3):
        try:
            ParallelConfig(data_parallel=8, zero_stage=stage)
            refused = None
        except ConfigError as err:
            refused = str(err)
        assert commands.runnable(cost.Candidate(8, 1, 1, 1, "none", zero=stage), one,
                                 req) == refused
    assert "machine" in commands.runnable(cost.Candidate(8, 1, 2, 2, "none"), two, req)
    assert commands.runnable(cost.Candidate(4, 1, 2, 2, "int8"), one, req) is None
    assert commands.runnable(cost.Candidate(16, 1, 1, 4, "none"), two, req) is None


def test_reasons_name_the_machine_boundary_and_memory():
    """The issue's 8192 x 48 transformer on 64 devices of 80 GB, 8 per machine."""
    hw = planner.hardware_from(64, 80, 300, 2400, 200, devices_per_machine=8)
    req = planner.Request(model="transformer", model_width=8192, model_depth=48,
                          global_batch_size=512)
    prof = profile.builtin_profile("transformer", 8192, 48)
    result = planner.plan(prof, hw, req)
    best = result["recommended"]
    assert best["memory_bytes"] <= 80e9 and best["tensor"] * best["pipeline"] >= 8
    text = "\n".join(best["neighbours"])
    assert "does not fit" in text or "slower" in text
    # Data parallelism alone would need all 38.7 B parameters' 619 GB of state per device.
    dp = planner._row(prof, hw, cost.Candidate(64, 1, 1, 8, "none"), req)
    assert not dp["fits"] and dp["memory_bytes"] > 600e9
    # Nothing tfpar.train runs across 8 machines today (data parallelism only) fits.
    assert result["runnable"] is None
    assert "inside one machine" in best["runnable"]
    # Pinned to tensor parallelism over 16 devices, the reason names the boundary.
    pinned = planner.plan(prof, hw, dataclasses.replace(req, tensor_parallel=4))
    hw16 = dataclasses.replace(hw, devices_per_machine=2)
    crossing = planner.plan(prof, hw16, dataclasses.replace(req, tensor_parallel=4))
    assert pinned["recommended"]["tensor"] == 4 == crossing["recommended"]["tensor"]
    assert crossing["recommended"]["parts"]["tensor_parallel"] > \
        pinned["recommended"]["parts"]["tensor_parallel"]


def test_formulas_give_the_published_parameter_counts():
    # Narayanan et al. 2021, Table 1: 1.7 B, 39.1 B, 1008 B.
    assert profile.gpt_profile(24, 2304, 24).params / 1e9 == pytest.approx(1.7, abs=0.05)
    assert profile.gpt_profile(48, 8192, 64).params / 1e9 == pytest.approx(39.1, abs=0.05)
    assert profile.gpt_profile(128, 25600, 160).params / 1e9 == pytest.approx(1008, abs=0.5)
    # Their FLOPs per iteration, 96·B·s·l·h²(1 + s/6h + V/16lh), counts a recomputed
    # forward: 4x the blocks' forward, 3x the head's.
    prof = profile.gpt_profile(48, 8192, 64)
    B, s, l, h, V = 1536, 2048, 48, 8192, 51200
    paper = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    ours = B * (4 * (prof.flops_per_example - prof.last_flops_per_example)
                + 3 * prof.last_flops_per_example)
    assert ours == pytest.approx(paper, rel=1e-9)


def test_commands_only_for_what_the_trainer_runs():
    # A model that needs recomputation on one machine: the runnable layout's command
    # carries --recompute=blocks, ZeRO only if tfpar.compat accepts it; tp x pp rows
    # recompute too (3D runs --recompute) but take no ZeRO.
    hw = planner.hardware_from(8, memory_gb=0.05, tflops=10, intra_gbps=100, inter_gbps=10)
    req = planner.Request(model="transformer", model_width=256, model_depth=8,
                          global_batch_size=256, zero=(0, 1, 2, 3), recompute="on")
    result = planner.plan(profile.builtin_profile("transformer", 256, 8), hw, req)
    runnable = result["runnable"]
    assert runnable is not None and runnable["runnable"] is None
    assert runnable["recompute"] and "--recompute=blocks" in runnable["command"]
    assert "recompute='blocks'" not in "\n".join(runnable["python"])
    assert "tfpar.recompute.every_layer(" in "\n".join(runnable["python"])
    assert runnable["command"].startswith("python -m tfpar.train --model=transformer")
    assert ("--zero_stage" in runnable["command"]) == bool(runnable["zero"])
    three_d = [r for r in result["ranked"] if r["tensor"] > 1 and r["pipeline"] > 1]
    assert three_d and all(r["recompute"] for r in three_d)
    for row in three_d:  # refused only for ZeRO or an aggregator the mesh lacks
        plain = row["zero"] == 0 and row["compression"] != "auto"
        assert (row["runnable"] is None) == plain, row
    try:
        ParallelConfig(data_parallel=8, zero_stage=1)
    except ConfigError:  # ZeRO refused by the trainer: marked, never given a command
        zero_rows = [r for r in result["ranked"] if r["zero"]]
        assert zero_rows and all(r["runnable"] for r in zero_rows)
        assert any("zero_stage" in r["runnable"] for r in zero_rows)
    assert "run: python -m tfpar.train" in planner.table(result, 5)


def test_micro_batches_without_a_pipeline_become_accumulation():
    hw = planner.hardware_from(4, 16, 10, 100, 10)
    row = planner._row(profile.builtin_profile("mlp"), hw,
                       cost.Candidate(4, 1, 1, 4, "none"), planner.Request(global_batch_size=256))
    cmd = commands.command(row, planner.Request(global_batch_size=256), hw)
    assert "--global_batch_size=64" in cmd and "--grad_accum_steps=4" in cmd
    assert "--data_parallel=4" in cmd


@pytest.mark.parametrize("candidate", [cost.Candidate(4, 1, 1, 1, "int8"),
                                       cost.Candidate(2, 1, 1, 4, "none"),
                                       cost.Candidate(2, 2, 1, 1, "none"),
                                       cost.Candidate(2, 1, 2, 4, "none", virtual=2)])
def test_python_calls_parse_and_name_the_users_function(candidate):
    import ast

    hw = planner.hardware_from(4, 16, 10, 100, 10)
    req = planner.Request(model="my_models:my_gpt", trainer_builds_it=False,
                          global_batch_size=64, schedule="interleaved", simulated_cpu=True)
    row = planner._row(profile.builtin_profile("transformer"), hw, candidate, req)
    lines = commands.python_calls(row, req, hw)
    ast.parse("\n".join(lines))
    assert lines[0] == "from my_models import my_gpt" and any("my_gpt()" in x for x in lines)
    assert "cpu_devices=4" in lines[3] and "split_cpu" in lines[5]


def test_chimera_is_priced_by_its_simulated_bubble_and_two_copies():
    from tfpar.pipeline.schedule import theory_bubble
    hw = dataclasses.replace(HW, intra_bandwidth=1e30)
    one_f = cost.Candidate(1, 1, 4, 8, "none")
    chim = dataclasses.replace(one_f, schedule="chimera")
    _, p1 = cost.step_seconds(PROFILE, hw, one_f, 64)
    _, pc = cost.step_seconds(PROFILE, hw, chim, 64)
    # Same compute; Chimera's idle share is its simulated schedule's (0.143 at K=4, M=8
    # against 1F1B's 0.273).
    assert pc["compute"] == pytest.approx(p1["compute"])
    assert pc["bubble"] / (pc["bubble"] + pc["compute"]) == pytest.approx(
        theory_bubble(4, 8, name="chimera"))
    assert pc["bubble"] < 0.6 * p1["bubble"]
    # The copies' exchange (gradients in, weights back) is priced on the stage link.
    slow = dataclasses.replace(HW, intra_bandwidth=1e6)
    extra = cost.step_seconds(PROFILE, slow, chim, 64)[1]["pipeline_p2p"] \
        - cost.step_seconds(PROFILE, slow, one_f, 64)[1]["pipeline_p2p"]
    assert extra == pytest.approx(2 * 4 * 250_000 / 1e6)  # a stage's fp32 gradients, twice


def test_planner_offers_chimera_where_it_wins_and_1f1b_where_it_does_not_fit():
    # Compute-bound 4-stage pipeline (pinned): Chimera's smaller bubble wins ...
    hw = dataclasses.replace(HW, intra_bandwidth=1e12, memory_bytes=1e9)
    req = planner.Request(global_batch_size=64, pipeline_stages=4, recompute="off")
    best = planner.plan(PROFILE, hw, req)["recommended"]
    assert best["schedule"] == "chimera" and best["runnable"] is None
    assert "--schedule=chimera" in best["command"]
    # ... unless its two copies do not fit: a device that holds 1F1B's state but not
    # Chimera's second copy of the weights and gradients.
    one_f = planner.plan(PROFILE, hw, dataclasses.replace(req, schedule="1f1b"))["recommended"]
    need = cost.memory_bytes(PROFILE, cost.Candidate(**{
        k: one_f[k] for k in ("data", "tensor", "pipeline", "microbatches", "compression")}),
        64)
    tight = dataclasses.replace(hw, memory_bytes=need * 1.01)
    best = planner.plan(PROFILE, tight, req)["recommended"]
    assert best["schedule"] == "1f1b"


def test_hierarchical_allreduce_ranks_first_only_over_a_slow_link():
    # 2 hosts x 2 workers, data parallelism: the leaders' ring carries 2(h-1)/h = 1x the
    # gradients over the network, the flat ring 2(n-1)/n = 1.5x.
    def plan(intra_gbps, inter_gbps, codec="none"):
        hw = planner.hardware_from(4, 16, 10, intra_gbps, inter_gbps, devices_per_machine=2)
        return planner.plan(PROFILE, hw, planner.Request(global_batch_size=64, data_parallel=4,
                                                         compression=codec))
    slow = plan(100, 0.1)["recommended"]
    assert slow["allreduce"] == "hierarchical" and slow["runnable"] is None
    assert "--allreduce=hierarchical" in slow["command"]
    flat = next(r for r in plan(100, 0.1)["ranked"] if r["allreduce"] == "flat"
                and r["compression"] == slow["compression"] and r["microbatches"] == 1)
    ratio = flat["parts"]["data_parallel"] / slow["parts"]["data_parallel"]
    assert 1.3 < ratio <= 1.5
    # Equal links: the two hand-offs inside each host cost as much as the network; flat.
    equal = plan(10, 10)["recommended"]
    assert equal["allreduce"] == "flat" and "--allreduce=flat" in equal["command"]
    # int8 all-gathers its codes: no hierarchical variant is offered for it.
    assert all(r["allreduce"] == "flat" for r in plan(100, 0.1, "int8")["ranked"]
               if r["compression"] == "int8")
    # One host: nothing to choose.
    hw = planner.hardware_from(4, 16, 10, 100, 0.1)
    assert all(r["allreduce"] == "flat" for r in planner.plan(
        PROFILE, hw, planner.Request(global_batch_size=64))["ranked"])


@pytest.mark.parametrize("hosts", [1, 2])
def test_every_offered_command_passes_the_trainers_checks(hosts):
    from absl import flags as absl_flags
    import shlex
    from tfpar import flags as tfpar_flags
    from tfpar import tf_config
    from tfpar.train import check_inputs
    hw = planner.hardware_from(4, 16, 10, 100, 0.1, devices_per_machine=4 // hosts)
    result = planner.plan(profile.builtin_profile("mlp"), hw,
                          planner.Request(global_batch_size=64))
    rows = [r for r in result["ranked"] if r["runnable"] is None]
    assert {r["schedule"] for r in rows} >= ({"1f1b", "chimera"} if hosts == 1 else {"1f1b"})
    if hosts == 2:
        assert {r["allreduce"] for r in rows} == {"flat", "hierarchical"}
    for row in rows:
        commands.attach(row, planner.Request(global_batch_size=64), hw)
        argv = shlex.split(row["command"].split("#")[0])[3:]  # after python -m tfpar.train
        values = absl_flags.FlagValues()
        tfpar_flags.define_flags(values)
        values(["tfpar.train", *argv])
        environ = {"TF_CONFIG": tf_config.make(
            [f"host{i // 2}:{23456 + i}" for i in range(4)], 0)} if hosts == 2 else {}
        check_inputs(tfpar_flags.config_from_flags(values), environ)
