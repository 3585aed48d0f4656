"""3D benchmark: the transformer on every data × tensor × pipeline layout of up to 8
logical CPUs, each trained by `python -m tfpar.train` in its own process, side by side.

    python tools/bench_3d.py --json=/tmp/3d.json
    python tools/bench_3d.py --quick        # two layouts, 3 steps: a smoke run

A layout is `DPxTPxPP` (data_parallel × tensor_parallel × pipeline_stages); it runs on
DP·TP·PP logical CPUs of one process. `1x1x1` is the single-device run the others are
read against. Pipelined layouts run `--microbatches` micro-batches with `--schedule`.
The layouts alternate within each of `--rounds` rounds, so that a slower spell of the
machine falls on all of them.

Per layout, from the run's metrics JSON (`tfpar.metrics`): step time (median over the
rounds of each run's median step; spread min–max of the rounds), examples/s, final loss,
and memory per device measured from the shards each device holds: parameters and
optimizer state (the largest device's, in KB) and that device's parameters as a fraction
of the model's (`1/(tp·pp)` is the aim; replicated vectors such as layer norms and
biases add to it). The allocator's peak is not per device here: the logical CPUs share
one allocator, so `memory.peak_bytes_per_device` is the process's and is not shown.

Output: a table, and JSON under runs/ (or --json): {"benchmark": "3d", "rows": [{"layout", "flags",
"step_ms", "step_ms_rounds", "examples_per_sec", "final_loss", "param_bytes_per_device",
"optimizer_state_bytes_per_device", "params_fraction", "error"?}], "rounds", "load_1min"}.
"""

import json
import os
import statistics
import time

from absl import app, flags

import train_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_list("layouts", ["1x1x1", "8x1x1", "4x2x1", "2x4x1", "4x1x2", "2x2x2",
                              "1x4x2", "1x2x2"],
                  "DPxTPxPP layouts to run (1x1x1 is the reference)")
flags.DEFINE_integer("batch", 64, "global batch size")
flags.DEFINE_integer("steps", 8, "training steps per run (the trainer's median step "
                                 "leaves out the first, traced one)")
flags.DEFINE_integer("microbatches", 4, "micro-batches of the pipelined layouts")
flags.DEFINE_string("schedule", "1f1b", "schedule of the pipelined layouts")
flags.DEFINE_string("optimizer", "adam", "optimizer")
flags.DEFINE_integer("rounds", 2, "rounds of all layouts")
flags.DEFINE_integer("timeout", 600, "seconds per run")
flags.DEFINE_bool("quick", False, "smoke run: layouts 1x1x1 and 2x2x2, 3 steps, 1 round")
flags.DEFINE_string("json", "", "write the results here (default runs/bench_3d_<time>.json)")


def layout_flags(layout):
    """`DPxTPxPP` -> the trainer's flags for that layout."""
    try:
        dp, tp, pp = (int(n) for n in layout.split("x"))
    except ValueError:
        raise app.UsageError(f"--layouts: {layout!r} is not DPxTPxPP, e.g. 2x2x2") from None
    out = [f"--cpu_devices={dp * tp * pp}", f"--data_parallel={dp}",
           f"--tensor_parallel={tp}", f"--pipeline_stages={pp}"]
    if pp > 1:
        out += [f"--microbatches={FLAGS.microbatches}", f"--schedule={FLAGS.schedule}"]
    return out


def run(layout):
    """Trains `layout` in a child; its metrics JSON, or {"error": the last tfpar line}."""
    metrics, error, _ = train_run.train(
        ["--model=transformer", f"--global_batch_size={FLAGS.batch}", f"--steps={FLAGS.steps}",
         f"--steps_per_epoch={FLAGS.steps}", f"--optimizer={FLAGS.optimizer}",
         *layout_flags(layout)], FLAGS.timeout)
    return metrics if error is None else {"error": error}


def row(layout, metrics_rounds, model_params):
    out = {"layout": layout, "flags": " ".join(layout_flags(layout))}
    failed = [m["error"] for m in metrics_rounds if "error" in m]
    if failed:
        out["error"] = failed[0]
        return out
    last = metrics_rounds[-1]
    memory = last["memory"]
    steps = [m["step_time_ms"]["median"] for m in metrics_rounds]
    out.update(step_ms=statistics.median(steps), step_ms_rounds=steps,
               examples_per_sec=statistics.median(m["examples_per_sec"]
                                                  for m in metrics_rounds),
               final_loss=last["final_loss"],
               param_bytes_per_device=max(memory["param_bytes_per_device"]),
               optimizer_state_bytes_per_device=max(
                   memory["optimizer_state_bytes_per_device"]),
               params_per_device=max(memory["params_per_device"]))
    if model_params:
        out["params_fraction"] = out["params_per_device"] / model_params
    return out


def main(argv):
    del argv
    if FLAGS.quick:
        FLAGS.layouts, FLAGS.steps, FLAGS.rounds = ["1x1x1", "2x2x2"], 3, 1
    for layout in FLAGS.layouts:
        layout_flags(layout)  # a malformed layout fails before any run
    results = {layout: [] for layout in FLAGS.layouts}
    loads = []
    for r in range(FLAGS.rounds):
        loads.append(round(os.getloadavg()[0], 2))
        for layout in FLAGS.layouts:
            metrics = run(layout)
            results[layout].append(metrics)
            print(f"round {r} {layout}: "
                  + (metrics.get("error") or "%.1f ms" % metrics["step_time_ms"]["median"]),
                  flush=True)
    loads.append(round(os.getloadavg()[0], 2))
    one = [m for m in results.get("1x1x1", []) if "error" not in m]
    model_params = one[0]["memory"]["params_per_device"][0] if one else None
    rows = [row(layout, results[layout], model_params) for layout in FLAGS.layouts]

    print(f"\ntransformer, global batch {FLAGS.batch}, {FLAGS.optimizer}, {FLAGS.steps} steps, "
          f"pipelines {FLAGS.schedule} over {FLAGS.microbatches} micro-batches; "
          f"{FLAGS.rounds} rounds, 1-minute load {loads}; model "
          f"{model_params or '?'} parameters")
    print(f"{'layout':>7} {'devices':>7} {'step ms [rounds]':>24} {'ex/s':>7} "
          f"{'final loss':>10} {'params KB/dev':>13} {'opt KB/dev':>10} {'of model':>8}")
    for r in rows:
        dp, tp, pp = (int(n) for n in r["layout"].split("x"))
        if "error" in r:
            print(f"{r['layout']:>7} {dp * tp * pp:>7}  {r['error']}")
            continue
        spread = f"[{min(r['step_ms_rounds']):.1f}-{max(r['step_ms_rounds']):.1f}]"
        fraction = f"{r['params_fraction']:.3f}" if "params_fraction" in r else "?"
        print(f"{r['layout']:>7} {dp * tp * pp:>7} {r['step_ms']:>10.1f} {spread:>13} "
              f"{r['examples_per_sec']:>7.0f} {r['final_loss']:>10.4f} "
              f"{r['param_bytes_per_device'] / 1024:>13.1f} "
              f"{r['optimizer_state_bytes_per_device'] / 1024:>10.1f} {fraction:>8}")
    path = FLAGS.json or os.path.join(ROOT, "runs", time.strftime("bench_3d_%Y%m%d_%H%M%S.json"))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": "3d", "rows": rows, "rounds": FLAGS.rounds,
                   "load_1min": loads}, f, indent=1)
    print(f"JSON: {path}")


if __name__ == "__main__":
    app.run(main)
