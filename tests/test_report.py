"""`tfpar.report` on metrics JSON fixtures: the bubble is labelled measured or theory (never
one standing in for the other), the pipeline picture is the measured timeline when the JSON
holds one and says "simulated" otherwise, summary.md compares losses at one step every run
reached, and the scaling chart draws one line per configuration."""

import json

import pytest

from tfpar import report


def _run(model="mlp", replicas=1, workers=1, compression="none", steps=60, loss0=2.0,
         eps=1000.0, **extra):
    losses = [loss0 - 0.01 * i for i in range(steps)]
    return {"config": {"model": model, "compression": compression, "global_batch_size": 64,
                       "cpu_devices": replicas, "steps": steps,
                       "metrics_json": f"runs/{model}_{replicas}_{compression}.json"},
            "strategy": "mirrored", "replicas": replicas, "workers": workers, "steps": steps,
            "final_loss": losses[-1], "loss_history": losses, "examples_per_sec": eps,
            "step_time_ms": {"median": 10.0, "p90": 12.0}, **extra}


def _pipeline(**extra):
    return {"stages": 2, "microbatches": 4, "schedule": "1f1b", "bubble_theory": 0.2, **extra}


def _rows(text):
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]


def test_summary_labels_the_bubble_measured_or_theory():
    text = report.summary([_run(pipeline=_pipeline()),
                           _run(pipeline=_pipeline(bubble_measured=0.237))])
    head, _, theory_only, measured = _rows(text)
    assert head[-2:] == ["bubble measured", "bubble theory"]
    assert theory_only[-2:] == ["not measured", "0.200"]
    assert measured[-2:] == ["0.237", "0.200"]


def test_summary_compares_losses_at_a_step_every_run_reached():
    # fp32 stopped at step 150, the compressed runs at 188 (as a wall-clock-bounded
    # benchmark does): their final losses are not comparable, their losses at 150 are.
    runs = [_run(steps=150, loss0=3.0), _run(steps=188, loss0=3.0, compression="int8")]
    text = report.summary(runs)
    head, _, fp32, int8 = _rows(text)
    assert head[2] == "loss at step 150 (mean of steps 141–150)"
    expected = sum(3.0 - 0.01 * i for i in range(140, 150)) / 10
    assert float(fp32[2]) == pytest.approx(expected, abs=1e-4)
    assert float(int8[2]) == pytest.approx(expected, abs=1e-4)
    assert float(int8[3]) == pytest.approx(3.0 - 0.01 * 187, abs=1e-4)  # its own last step
    assert "compared at step 150" in text


def test_scaling_chart_draws_one_line_per_configuration():
    runs = [_run(replicas=r, eps=e) for r, e in [(1, 1000), (2, 1800), (4, 3000)]]
    runs += [_run(replicas=2, workers=2, compression=c, eps=e)
             for c, e in [("none", 13), ("int8", 44), ("topk", 188)]]
    runs += [_run(replicas=2, eps=2000)]  # a repeat at 2 replicas: median, not a zig-zag
    runs += [_run(replicas=2, pipeline=_pipeline())]  # pipelines are not in the chart
    groups = report.scaling_groups(runs)
    assert len(groups) == 4, groups
    local = groups["mlp"]
    assert [r for r, _ in local] == [1, 2, 4]
    assert local[1][1] in (1800, 2000)
    for name, points in groups.items():
        xs = [r for r, _ in points]
        assert xs == sorted(set(xs)), (name, points)
    assert groups["mlp 2 workers int8"] == [(2, 44)]


def test_pipeline_picture_is_measured_when_the_json_has_a_timeline():
    tl = {"actions": [[["F0", 0, 1000], ["B0", 3000, 5000]], [["F0", 1000, 3000]]],
          "busy": [[[0, 1000], [3000, 5000]], [[1000, 3000]]], "makespan_us": 5000,
          "bubble": 0.5}
    rows, xlabel, title = report.pipeline_rows(_pipeline(timeline=tl))
    assert xlabel == "ms" and "measured timeline" in title and "simulated" not in title
    assert rows[0][1] == ("B0", 3.0, 5.0)
    rows, xlabel, title = report.pipeline_rows(_pipeline())
    assert "simulated schedule (not measured)" in title and "bubble not measured" in title
    assert len(rows) == 2 and len(rows[0]) == 8  # 4 forwards + 4 backwards on stage 0


def test_report_writes_charts_and_summary(tmp_path):
    pytest.importorskip("matplotlib")
    paths = []
    for i, run in enumerate([_run(), _run(replicas=2, eps=1800),
                             _run(replicas=2, pipeline=_pipeline(bubble_measured=0.25)),
                             _run(replicas=2, workers=2, compression="int8",
                                  comm={"bytes_on_wire_per_step": 1e6,
                                        "bytes_uncompressed_per_step": 4e6,
                                        "compression_ratio": 4.0})]):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    written = report.report([str(p) for p in paths], str(tmp_path / "out"))
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == ["communication.png", "loss.png", "pipeline_1f1b_K2_M4.png",
                     "scaling.png", "summary.md"]
    assert "bubble measured" in (tmp_path / "out" / "summary.md").read_text()
