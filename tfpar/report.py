"""`python -m tfpar.report RUN.json... --out_dir=DIR`: charts and a summary of runs.

Reads metrics JSON files (the shape `tfpar.metrics` documents, as `--metrics_json` and the
benchmarks write them) and draws what a person would rather look at than read:
- `loss.png`: loss against step of every run on one plot (does the distributed run
  converge like the single-device run?);
- `scaling.png`: speedup and scaling efficiency against replicas, one line per
  configuration (runs that differ only in their replica count; see `scaling_groups`);
- `communication.png`: bytes on the wire per step and communication share, per aggregator
  (a run whose share was not measured says so instead of showing 0);
- `pipeline_<schedule>_K<k>_M<m>.png`: the measured timeline when the run's JSON holds one
  (`pipeline.timeline`, from `tfpar.pipeline.timeline.to_dict`), else the schedule's
  simulated timeline, titled as simulated;
and `summary.md`, a table of every run: losses compared at one step all runs reached, and
the bubble as measured and as theory in separate columns (never one standing in for the
other).
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


def label(run, replicas=True):
    cfg = run.get("config", {})
    parts = [cfg.get("model", "?")] + ([f"{run.get('replicas', 1)}x"] if replicas else [])
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


# Settings that say how many devices a run used, or where it wrote: runs that differ only
# in these are the same configuration at another scale.
_SCALE_KEYS = {"cpu_devices", "data_parallel", "strategy", "collective", "steps",
               "steps_per_epoch", "checkpoint_dir", "checkpoint_every", "keep_checkpoints",
               "checkpoint_async", "tensorboard_dir", "metrics_json", "measure_comm", "verbose", "export_dir",
               "collective_timeout_s", "heartbeat_timeout_s", "startup_timeout_s"}


def scaling_groups(runs):
    """Runs for the scaling chart, grouped by configuration: one group per distinct
    (config minus device counts and output paths, number of workers). Pipelined runs and
    runs without a throughput are left out. Returns {group label: [(replicas, median
    examples/s of the runs at that count), ...] sorted by replicas}."""
    groups, labels = {}, {}
    for run in runs:
        if "examples_per_sec" not in run or "pipeline" in run:
            continue
        cfg = run.get("config", {})
        key = json.dumps([{k: v for k, v in cfg.items() if k not in _SCALE_KEYS},
                          run.get("workers", 1)], sort_keys=True, default=str)
        groups.setdefault(key, {}).setdefault(run.get("replicas", 1), []).append(
            run["examples_per_sec"])
        labels.setdefault(key, label(run, replicas=False))
    out = {}
    for key, by_replicas in groups.items():
        name = labels[key]
        while name in out:  # two configurations that print alike
            name += "'"
        out[name] = sorted((r, float(sorted(v)[len(v) // 2])) for r, v in by_replicas.items())
    return out


def plot_scaling(runs, path, plt):
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    groups = scaling_groups(runs)
    alone = [name for name, points in groups.items() if len(points) == 1]
    for name, points in groups.items():
        if len(points) == 1:  # one replica count: nothing to scale against
            continue
        base_replicas, base = points[0]
        xs = [r for r, _ in points]
        speedup = [eps / base for _, eps in points]
        left.plot(xs, speedup, "o-", label=name)
        right.plot(xs, [s / (x / base_replicas) for x, s in zip(xs, speedup)], "o-",
                   label=name)
    if alone:
        fig.text(0.01, 0.01, "one replica count only, not drawn: " + ", ".join(alone),
                 fontsize=7)
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
    shares = [c.get("comm_time_fraction") for _, c in rows]
    right.barh(names, [0.0 if v is None else v for v in shares])
    for i, v in enumerate(shares):
        if v is None:
            right.text(0.02, i, "not measured (--measure_comm)", va="center", fontsize=7)
    right.set(xlabel="share of the step", title="Communication share", xlim=(0, 1))
    left.invert_yaxis()
    right.invert_yaxis()
    right.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pipeline_rows(block):
    """What `plot_pipeline` draws for a run's `pipeline` block: `(rows, xlabel, title)`,
    rows per stage of (label, start, end). The measured timeline when the block holds one,
    else the schedule's simulation (forward = 1 time unit), said in the title."""
    from tfpar.pipeline import schedule as schedule_lib

    K, M = block["stages"], block["microbatches"]
    V = block.get("virtual_stages", 1)
    head = f"{block['schedule']}: K={K}, M={M}"
    if "timeline" in block:
        tl = block["timeline"]
        rows = [[(name, b / 1e3, e / 1e3) for name, b, e in row] for row in tl["actions"]]
        return rows, "ms", f"{head}, measured timeline, bubble {tl['bubble']:.3f}"
    sim = schedule_lib.simulate(schedule_lib.make_schedule(block["schedule"], K, M, V), K, M, V)
    rows = [[(str(a), b, e) for a, b, e in row] for row in sim.timeline]
    measured = (f"; measured bubble {block['bubble_measured']:.3f}"
                if "bubble_measured" in block else "; bubble not measured")
    return rows, "time (F=1)", (f"{head}, simulated schedule (not measured), bubble "
                                f"{sim.bubble:.3f}{measured}")


def plot_pipeline(block, path, plt):
    rows, xlabel, title = pipeline_rows(block)
    K = len(rows)
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.5 * K))
    for s, row in enumerate(rows):
        for name, start, end in row:
            color = "tab:blue" if name.startswith("F") else "tab:orange"
            ax.barh(s, end - start, left=start, color=color, edgecolor="white")
            ax.text((start + end) / 2, s, name, ha="center", va="center", fontsize=6)
    ax.set(yticks=range(K), yticklabels=[f"stage {s}" for s in range(K)], xlabel=xlabel,
           title=title)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def common_step(runs, window=10):
    """The step every run with a loss history reached, and the window of steps ending there
    whose mean loss `summary` compares: `(step, window)`, or `(None, 0)`."""
    lengths = [len(r["loss_history"]) for r in runs if r.get("loss_history")]
    if not lengths:
        return None, 0
    step = min(lengths)
    return step, min(window, step)


def loss_at(run, step, window):
    """Mean loss of steps `step - window + 1 .. step` (1-based), or None."""
    losses = run.get("loss_history") or []
    if step is None or len(losses) < step:
        return None
    return sum(losses[step - window:step]) / window


def _fmt(value, spec):
    return "" if value is None else format(value, spec)


def summary(runs):
    step, window = common_step(runs)
    at = (f"loss at step {step} (mean of steps {step - window + 1}–{step})"
          if step else "loss at a common step")
    lines = [f"| run | steps | {at} | final loss | examples/s | step ms (median) "
             "| MB/step on wire | compression × | bubble measured | bubble theory |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        comm = run.get("comm", {})
        pipe = run.get("pipeline", {})
        lines.append(
            f"| {label(run)} | {run.get('steps', '')} "
            f"| {_fmt(loss_at(run, step, window), '.4f')} "
            f"| {_fmt(run.get('final_loss'), '.4f')} "
            f"| {_fmt(run.get('examples_per_sec'), '.0f')} "
            f"| {_fmt(run.get('step_time_ms', {}).get('median'), '.1f')} "
            f"| {_fmt(comm.get('bytes_on_wire_per_step', 0) / 1e6, '.3f')} "
            f"| {_fmt(comm.get('compression_ratio', 1), '.1f')} "
            f"| {_fmt(pipe.get('bubble_measured'), '.3f') or ('not measured' if pipe else '')} "
            f"| {_fmt(pipe.get('bubble_theory'), '.3f')} |")
    if step:
        lines += ["", f"Losses are compared at step {step}, the last step every run with a "
                  f"loss history reached (mean of its last {window} steps); `final loss` is "
                  "each run's own last step (see `steps`)."]
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
