"""`python -m tfpar.report RUN.json... --out_dir=DIR`: charts and a summary of runs.

Reads metrics JSON files (the DESIGN.md shape, as `--metrics_json` and the benchmarks write
them) and draws what a person would rather look at than read:
- `loss.png`: loss against step of every run on one plot (does the distributed run
  converge like the single-device run?);
- `scaling.png`: speedup and scaling efficiency against replicas, per model;
- `communication.png`: bytes on the wire per step and communication share, per aggregator;
- `pipeline_<schedule>.png`: the timeline of each pipeline schedule in the runs;
and `summary.md`, a table of every run.
"""

import json
import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags(flag_values=FLAGS):
    """The report's flags (only `run()` calls this: importing defines none)."""
    if "out_dir" not in flag_values:
        flags.DEFINE_string("out_dir", "runs/report", "Where to write the PNGs and "
                            "summary.md.", flag_values=flag_values)
    flag_values.register_key_flag_for_module(sys.argv[0], flag_values["out_dir"])


def label(run):
    cfg = run.get("config", {})
    parts = [cfg.get("model", "?"), f"{run.get('replicas', 1)}x"]
    if run.get("workers", 1) > 1:
        parts.append(f"{run['workers']} workers")
    if cfg.get("compression", "none") != "none":
        parts.append(cfg["compression"])
    if "pipeline" in run:
        parts.append(f"pp{run['pipeline']['stages']} {run['pipeline']['schedule']}")
    return " ".join(parts)


def load(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        run["_name"] = os.path.splitext(os.path.basename(path))[0]
        runs.append(run)
    return runs


def plot_loss(runs, path, plt):
    fig, ax = plt.subplots(figsize=(7, 4))
    import numpy as np

    for run in runs:
        losses = np.asarray(run.get("loss_history") or [], dtype=float)
        if losses.size:
            # Per-batch losses are noisy: plot the mean of the last `window` steps.
            window = max(1, min(10, losses.size // 5))
            smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(window - 1, losses.size), smooth, label=label(run), linewidth=1)
    ax.set(xlabel="step", ylabel="training loss (moving mean of 10 steps)",
           title="Convergence", yscale="log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(runs, path, plt):
    by_model = {}
    for run in runs:
        if "examples_per_sec" in run and "pipeline" not in run:
            by_model.setdefault(run.get("config", {}).get("model", "?"), []).append(run)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for model, group in by_model.items():
        base = min(group, key=lambda r: r.get("replicas", 1))
        points = sorted((r.get("replicas", 1), r["examples_per_sec"] / base["examples_per_sec"])
                        for r in group)
        xs = [p[0] for p in points]
        left.plot(xs, [p[1] for p in points], "o-", label=model)
        right.plot(xs, [p[1] / (x / base.get("replicas", 1)) for x, p in zip(xs, points)],
                   "o-", label=model)
    left.set(xlabel="replicas", ylabel="speedup (examples/s)", title="Speedup")
    right.set(xlabel="replicas", ylabel="efficiency", title="Scaling efficiency", ylim=(0, 1.2))
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_communication(runs, path, plt):
    rows = [(label(r), r["comm"]) for r in runs if "comm" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 0.6 + 0.4 * max(2, len(rows))))
    names = [name for name, _ in rows]
    left.barh(names, [c["bytes_on_wire_per_step"] / 1e6 for _, c in rows])
    left.set(xlabel="MB on the wire per step", title="Bytes per step")
    right.barh(names, [c.get("comm_time_fraction", 0.0) for _, c in rows])
    right.set(xlabel="share of the step", title="Communication share", xlim=(0, 1))
    left.invert_yaxis()
    right.invert_yaxis()
    right.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_pipeline(block, path, plt):
    from tfpar.pipeline import schedule as schedule_lib

    K, M = block["stages"], block["microbatches"]
    V = block.get("virtual_stages", 1)
    sim = schedule_lib.simulate(schedule_lib.make_schedule(block["schedule"], K, M, V), K, M, V)
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.5 * K))
    for s, row in enumerate(sim.timeline):
        for action, start, end in row:
            color = "tab:blue" if action.kind == "F" else "tab:orange"
            ax.barh(s, end - start, left=start, color=color, edgecolor="white")
            ax.text((start + end) / 2, s, str(action), ha="center", va="center", fontsize=6)
    ax.set(yticks=range(K), yticklabels=[f"stage {s}" for s in range(K)], xlabel="time (F=1)",
           title=f"{block['schedule']}: K={K}, M={M}, bubble {sim.bubble:.3f}"
                 + (f" (measured {block['bubble_measured']:.3f})"
                    if "bubble_measured" in block else ""))
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(runs):
    lines = ["| run | steps | final loss | examples/s | step ms (median) | MB/step on wire "
             "| compression × | bubble |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        comm = run.get("comm", {})
        pipe = run.get("pipeline", {})
        lines.append(
            f"| {label(run)} | {run.get('steps', '')} | {run.get('final_loss', float('nan')):.4f} "
            f"| {run.get('examples_per_sec', 0):.0f} "
            f"| {run.get('step_time_ms', {}).get('median', 0):.1f} "
            f"| {comm.get('bytes_on_wire_per_step', 0) / 1e6:.3f} "
            f"| {comm.get('compression_ratio', 1):.1f} "
            f"| {pipe.get('bubble_measured', pipe.get('bubble_theory', '')) or ''} |")
    return "\n".join(lines) + "\n"


def report(paths, out_dir):
    """Writes the charts and summary.md for the runs in `paths`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load(paths)
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def out(name):
        written.append(os.path.join(out_dir, name))
        return written[-1]

    plot_loss(runs, out("loss.png"), plt)
    if any("examples_per_sec" in r for r in runs):
        plot_scaling(runs, out("scaling.png"), plt)
    if any("comm" in r for r in runs):
        plot_communication(runs, out("communication.png"), plt)
    for block in {json.dumps(r["pipeline"], sort_keys=True): r["pipeline"]
                  for r in runs if "pipeline" in r}.values():
        plot_pipeline(block, out(f"pipeline_{block['schedule']}_K{block['stages']}"
                                 f"_M{block['microbatches']}.png"), plt)
    with open(out("summary.md"), "w") as f:
        f.write(summary(runs))
    return written


def main(argv):
    if len(argv) < 2:
        print("tfpar.report: error: give one or more metrics JSON files", file=sys.stderr)
        sys.exit(2)
    for path in report(argv[1:], FLAGS.out_dir):
        print(path)


def run():
    """`tfpar-report` / `python -m tfpar.report`."""
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
