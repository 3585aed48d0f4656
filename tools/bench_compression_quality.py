"""Does a lossy aggregator at its defaults end where fp32 ends? Every task, two seeds.

Trains each task with fp32 (`--compression=none`) and then with every lossy aggregator at
its defaults (the `ParallelConfig` defaults: what a user gets from `--compression=X` alone),
same seed, same batches, same steps, on `--cpu_devices` logical CPUs in one process
(`tfpar.train.train` reusing one runtime; quality needs no shaped link). Tasks: the three
generated ones (`mlp` teacher classification, `convnet` pattern images, `transformer` on
`tfpar.data.lookup_task`) and a user-style `--dataset` pipeline (`user` = tests/user_data.py's
`sign_of_sum`, with its own held-out batches).

The transformer's task here is not the trainer's default (sequence reversal, kept as
`--tasks=transformer_reverse`): reversal reaches a loss of ~0.001 in a default-length run,
where a relative gap of 2 % is below the spread between seeds and says nothing about the
aggregator. `lookup_task` (next token from a random table of the last two tokens) still
learns for the whole run and ends well above zero, so an aggregator that slows learning
shows as a higher final loss.

    python tools/bench_compression_quality.py      # everything: 2 seeds x 4 tasks x 8 runs
    python tools/bench_compression_quality.py --tasks=mlp --seeds=0 --aggregators=topk
    python tools/bench_compression_quality.py --set topk_ratio=0.05  # try other settings
    python tools/bench_compression_quality.py --base zero_stage=3 --reference=keras \
        --aggregators=int8 --set zero_gather=int8   # ZeRO-3 with ZeRO++'s collectives

The reference is fp32 twice: the trainer's `--compression=none` (Keras's own all-reduce) and
`fp32-exact`, the same sums through the exact fp32 aggregator (`NoneAggregator`, what every
lossy aggregator is built on; `tfpar.optimizers.always_bucketed()`). With
2 replicas the fp32 sum `a + b` does not depend on the order, so the two agree wherever the
paths agree (mlp, convnet, user); on the transformer they differ: Keras all-reduces the token
embedding's gradient as `IndexedSlices` and its Adam adds the squares of every slice to `v`
(a token seen 30 times in a batch counts 30 squares), where an aggregator sums the gradient
densely first (the square of the sum). Lossy runs are judged against `fp32-exact`
(`--reference=keras`: against the trainer's fp32), so a gap is what compression costs.

Top-k and PowerSGD (with Adam, `--compress_adam_step`) do two things fp32 does not: they
freeze Adam's second moment after `--adam_warmup_steps`, and they compress. `frozen-v` is
the first alone: the exact fp32 aggregator with Adam in front and `v` frozen at the same
step, nothing dropped (what top-k at ratio 1.0 computes, without its top-k pass). It runs
once per task and seed when an Adam-in-front aggregator is in the list (`--frozen_reference`)
and `v` freezes within the run (more steps than `--adam_warmup_steps`),
with the lossy runs' `--set` overrides, and those runs print their gap to it beside the
judged gap (`vs frozen`): compression's own cost. The verdict stays against fp32.

Per run: the final loss (mean of the last `--smooth` batch losses; every run sees the same
batches, so the means compare like for like), its relative gap to fp32's, and held-out loss
and accuracy (`--validation_steps` batches of examples the training stream never reaches,
after the last step). A run FAILS when its final loss is more than `--max_loss_gap` above
fp32's or its held-out accuracy more than `--max_acc_drop` below. Prints a table, writes
`--out` (JSON) and exits 1 if any run failed.

fp32's own spread (`--fp32_seeds=2,3,4`): a lossy run is one more trajectory on its task
and batches, so it is judged against how far fp32's trajectories on the same task and
batches land from each other. For each task and seed the reference fp32 run is repeated
with each listed seed as the model's initialisation only (the task, its table or teacher,
and every batch stay the seed's); the band is the range of those final losses over their
mean, printed (`fp32 band ±x %`) and written (`bands`, and `band` on each judged row), and
a run also FAILS when its gap is outside ± the band, below as well as above. A band from n
runs is itself a sample (a further fp32 run lands outside the range of n with probability
2 / (n + 1)): the more seeds, the more the band says.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tests"))  # user_data.py: the user-style pipeline

EXACT = "fp32-exact"  # the reference: fp32 through the exact aggregator
FROZEN = "frozen-v"  # diagnostic: Adam in front, v frozen, nothing dropped (module docstring)
LOSSY = ("fp16", "bf16", "int8", "lowbit", "topk", "threshold", "powersgd", "auto")
TASKS = {"mlp": {"model": "mlp"}, "convnet": {"model": "convnet"},
         "transformer": {"model": "transformer", "task": "lookup"},
         "user": {"model": "mlp", "dataset": "user_data:sign_of_sum", "num_classes": 2},
         # not in the default list: the trainer's own transformer task, which saturates
         "transformer_reverse": {"model": "transformer"}}
DEFAULT_TASKS = ("mlp", "convnet", "transformer", "user")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma list of " + ", ".join(TASKS))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--aggregators", default=",".join(LOSSY),
                   help="lossy aggregators to compare with fp32 (fp32 always runs); a variant "
                   "is NAME:FIELD=VALUE[:FIELD=VALUE...], e.g. topk:topk_ratio=0.05")
    p.add_argument("--steps", type=int, default=0,
                   help="steps per run; 0 = the trainer's default (a default-length run)")
    p.add_argument("--global_batch_size", type=int, default=0, help="0 = trainer default")
    p.add_argument("--cpu_devices", type=int, default=2)
    p.add_argument("--validation_steps", type=int, default=8)
    p.add_argument("--smooth", type=int, default=10)
    p.add_argument("--max_loss_gap", type=float, default=0.02,
                   help="fail when final loss > fp32's × (1 + this)")
    p.add_argument("--fp32_seeds", default="",
                   help="comma list of initialisation seeds: the reference fp32 run is "
                   "repeated with each on the same task and batches (task seed = the cell's "
                   "seed), and a cell fails when its gap is outside ± the band, the range of "
                   "those fp32 final losses over their mean (module docstring)")
    p.add_argument("--max_acc_drop", type=float, default=0.04,
                   help="fail when held-out accuracy < fp32's − this (default: about two "
                   "binomial standard deviations of an accuracy near 0.66 on the 8 × 64 "
                   "held-out examples; fp16, lossless by its loss, moved it by 0.021)")
    p.add_argument("--reference", choices=("exact", "keras"), default="exact",
                   help="what the lossy runs are judged against: fp32 through the exact "
                   "aggregator (the same path as theirs; default) or the trainer's fp32 "
                   "(Keras's all-reduce); both fp32 runs are printed with exact")
    p.add_argument("--frozen_reference", choices=("auto", "on", "off"), default="auto",
                   help="run the frozen-v diagnostic (auto: when an aggregator in the list "
                   "takes Adam in front of compression)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ParallelConfig field for the lossy runs (repeatable)")
    p.add_argument("--base", action="append", default=[], metavar="FIELD=VALUE",
                   help="a ParallelConfig field for every run, fp32's too (repeatable), "
                        "e.g. zero_stage=3 (with --reference=keras: the exact aggregator "
                        "is tf.distribute's)")
    p.add_argument("--out", default="runs/compression_quality.json")
    return p.parse_args(argv)


def _value(text):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


# Aggregator options that are not ParallelConfig fields, set on the aggregator a variant
# builds (`powersgd:adam_variance=live:adam_refresh_every=25`, `auto:adam_variance=local`;
# the values are `Aggregator.set_adam_variance`'s: frozen, live, local, local_debiased).
AGGREGATOR_OPTIONS = ("adam_variance", "adam_refresh_every")


def overrides(pairs, aggregator_options=None):
    from tfpar import ParallelConfig
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if aggregator_options is not None and name in AGGREGATOR_OPTIONS and _:
            aggregator_options[name] = _value(value)
            continue
        if name not in fields or not _:
            sys.exit(f"bench_compression_quality: error: --set={pair!r} is invalid: "
                     f"use FIELD=VALUE with a ParallelConfig field, e.g. topk_ratio=0.05")
        out[name] = _value(value)
    return out


def final_loss(history, smooth):
    tail = history[-smooth:]
    return sum(tail) / len(tail)


def run_one(base, spec, extra, runtime, smooth, task_seed=None):
    """One run; `task_seed`: the task and its batches from this seed, the model's
    initialisation from `base["seed"]` (the band's fp32 runs)."""
    from tfpar import ParallelConfig, data
    from tfpar.train import train
    compression, *pairs = spec.split(":") if spec not in (EXACT, FROZEN) else ("none",)
    options = {}
    settings = ({**extra, **overrides(pairs, options)} if compression != "none" or spec == FROZEN
                else {})
    base = dict(base)
    task = base.pop("task", None)
    config = ParallelConfig(**{**base, **settings, "compression": compression})
    if runtime[0] is None:  # one runtime (strategy) for every run of the process
        from tfpar import backends
        runtime[0] = backends.for_config(config).build_runtime(config, None, None)
    start = time.perf_counter()
    from tfpar import optimizers
    default_task = data.DEFAULT_TASKS[config.model]
    if task == "lookup":  # the suite's transformer task (module docstring)
        data.DEFAULT_TASKS[config.model] = data.lookup_task
    if task_seed is not None:  # (a `--dataset` pipeline takes no seed: nothing to fix)
        make_task = data.DEFAULT_TASKS[config.model]
        data.DEFAULT_TASKS[config.model] = lambda _seed: make_task(task_seed)
    from tfpar import compression as comp
    make_aggregator = comp.make_aggregator
    if spec == FROZEN:  # ... with Adam in front, v frozen after adam_warmup_steps
        comp.make_aggregator = lambda c, **kw: comp.NoneAggregator(
            bucket_mb=c.bucket_mb, adam=(0.9, 0.999, 1e-7),
            adam_warmup_steps=c.adam_warmup_steps)
    elif options:
        def with_options(c, **kw):
            agg = make_aggregator(c, **kw)
            # A refresh alone means 0/1 Adam's frozen `v` (the default `v` of PowerSGD and
            # auto is per replica, which a refresh does not apply to).
            variance = options.get("adam_variance", "frozen" if "adam_refresh_every" in options
                                   else agg.adam_variance)
            agg.set_adam_variance(variance,
                                  options.get("adam_refresh_every", agg.adam_refresh_every))
            return agg
        comp.make_aggregator = with_options
    # fp32 through the exact aggregator (module docstring) for the exact and frozen runs.
    bucketed = optimizers.always_bucketed() if spec in (EXACT, FROZEN) else contextlib.nullcontext()
    try:
        with bucketed:
            result, _ = train(config, runtime=runtime[0])
    finally:
        data.DEFAULT_TASKS[config.model] = default_task
        comp.make_aggregator = make_aggregator
    val = result.get("validation", {})
    finite = all(math.isfinite(v) for v in result["loss_history"])
    return {"compression": compression, "run": spec,
            "final_loss": final_loss(result["loss_history"], smooth),
            "last_batch_loss": result["final_loss"], "val_loss": val.get("loss", math.nan),
            "val_accuracy": val.get("accuracy", math.nan), "finite": finite,
            "steps": len(result["loss_history"]), "seconds": time.perf_counter() - start,
            "auto": (result.get("comm") or {}).get("auto"),
            "comm": {k: (result.get("comm") or {}).get(k) for k in (
                "bytes_on_wire_per_step", "bytes_uncompressed_per_step", "compression_ratio")},
            "config": {k: getattr(config, k) for k in (
                "topk_ratio", "topk_warmup_steps", "topk_dense_below", "topk_union",
                "topk_momentum_carry", "threshold", "lowbit_bits", "powersgd_rank",
                "powersgd_start_step", "compress_adam_step", "adam_warmup_steps", "auto_budget_ms",
                "auto_link_mbps", "error_feedback", "bucket_mb", "steps",
                "global_batch_size", "optimizer", "learning_rate")}, "options": options}


def adam_in_front(row):
    """Whether the run took Adam in front of compression (so `frozen-v` applies to it)."""
    from tfpar.compression import ADAM_STEP_AGGREGATORS
    c = row["config"]
    return (row["compression"] in ADAM_STEP_AGGREGATORS and c["compress_adam_step"]
            and c["optimizer"] == "adam" and c["adam_warmup_steps"] > 0)


def fp32_band(losses):
    """The band of fp32's own spread: (max − min) / mean of its final losses (≥ 2 runs)."""
    return (max(losses) - min(losses)) / (sum(losses) / len(losses))


def judge(row, ref, args, frozen=None, band=None):
    """Marks `row` failing (its `fails`) above `--max_loss_gap`, outside ± `band` (when
    given), below `--max_acc_drop` or non-finite."""
    row["loss_gap"] = row["final_loss"] / ref["final_loss"] - 1
    if (frozen is not None and adam_in_front(row) and row["config"]["adam_warmup_steps"]
            == frozen["config"]["adam_warmup_steps"]):
        row["loss_gap_vs_frozen"] = row["final_loss"] / frozen["final_loss"] - 1
    row["acc_drop"] = ref["val_accuracy"] - row["val_accuracy"]
    bad = []
    if not row["finite"]:
        bad.append("non-finite loss")
    if row["loss_gap"] > args.max_loss_gap:
        bad.append(f"loss {row['loss_gap']:+.1%}")
    if band is not None:
        row["band"] = band
        if abs(row["loss_gap"]) > band:
            bad.append(f"loss {row['loss_gap']:+.1%} outside fp32's ±{band:.1%}")
    if row["acc_drop"] > args.max_acc_drop:
        bad.append(f"accuracy −{row['acc_drop']:.3f}")
    row["fails"] = bad
    return row


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    extra = overrides(args.set)
    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in TASKS:
            sys.exit(f"bench_compression_quality: error: --tasks={t!r} is invalid: "
                     f"choose from {', '.join(TASKS)}")
    aggregators = [a for a in args.aggregators.split(",") if a and a != "none"]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    band_seeds = [int(s) for s in args.fp32_seeds.split(",") if s]
    from tfpar import ParallelConfig, cpu_kernels  # after argparse: --help stays fast
    # Before TensorFlow starts in this process, as `python -m tfpar.train` does.
    cpu_kernels.select(extra.get("cpu_kernels", "auto"))
    common = {"cpu_devices": args.cpu_devices, "validation_steps": args.validation_steps,
              "verbose": 0, **overrides(args.base)}
    if args.steps:
        common["steps"] = args.steps
    if args.global_batch_size:
        common["global_batch_size"] = args.global_batch_size
    runtime = [None]
    rows = []
    width = max([len(EXACT), *(len(a) for a in aggregators)])
    frozen_on = args.frozen_reference == "on" or (
        args.frozen_reference == "auto" and any(
            a.split(":")[0] in ("topk", "powersgd") for a in aggregators))
    width = max(width, len(FROZEN))
    print(f"{'task':12} {'seed':>4} {'aggregator':{width}} {'final loss':>10} {'vs ref':>8} "
          f"{'vs frozen':>9} {'val acc':>7} {'Δacc':>6}  verdict", flush=True)
    for seed in seeds:  # seed-major: a cut-short run still has every task once
        for task in tasks:
            base = {**common, **TASKS[task], "seed": seed}
            keras_ref = run_one(base, "none", extra, runtime, args.smooth)
            keras_ref.update(task=task, seed=seed, loss_gap=0.0, acc_drop=0.0, fails=[],
                             reference="keras")
            rows.append(keras_ref)
            print(f"{task:12} {seed:4d} {'fp32':{width}} {keras_ref['final_loss']:10.4f} "
                  f"{'—':>8} {'':>9} {keras_ref['val_accuracy']:7.3f} {'—':>6}  "
                  f"({keras_ref['seconds']:.0f} s)", flush=True)
            ref = keras_ref
            if args.reference == "exact":
                ref = run_one(base, EXACT, extra, runtime, args.smooth)
                ref.update(task=task, seed=seed, reference="exact", fails=[],
                           loss_gap_vs_keras=ref["final_loss"] / keras_ref["final_loss"] - 1)
                ref["loss_gap"], ref["acc_drop"] = 0.0, 0.0
                rows.append(ref)
                print(f"{task:12} {seed:4d} {EXACT:{width}} {ref['final_loss']:10.4f} "
                      f"{ref['loss_gap_vs_keras']:+8.1%} {'':>9} {ref['val_accuracy']:7.3f} "
                      f"{ref['val_accuracy'] - keras_ref['val_accuracy']:+6.3f}  reference; "
                      f"vs fp32 ({ref['seconds']:.0f} s)", flush=True)
            band = None
            if band_seeds:
                band = measure_band(rows, base, ref, band_seeds, extra, runtime, args,
                                    task, seed, width)
                save(args, extra, rows, {}, None)
            frozen = None
            probe = ParallelConfig(**{**{k: v for k, v in base.items() if k != "task"}, **extra})
            if frozen_on and probe.steps > probe.adam_warmup_steps:  # else v never freezes
                frozen = run_one(base, FROZEN, extra, runtime, args.smooth)
                frozen.update(task=task, seed=seed, reference="frozen", fails=[],
                              loss_gap=frozen["final_loss"] / ref["final_loss"] - 1,
                              acc_drop=ref["val_accuracy"] - frozen["val_accuracy"])
                rows.append(frozen)
                print(f"{task:12} {seed:4d} {FROZEN:{width}} {frozen['final_loss']:10.4f} "
                      f"{frozen['loss_gap']:+8.1%} {'':>9} {frozen['val_accuracy']:7.3f} "
                      f"{-frozen['acc_drop']:+6.3f}  diagnostic, not judged "
                      f"({frozen['seconds']:.0f} s)", flush=True)
            for agg in aggregators:
                try:
                    row = judge(run_one(base, agg, extra, runtime, args.smooth), ref, args,
                                frozen, band)
                except Exception as err:  # noqa: BLE001 — one broken run must not end the suite
                    row = {"compression": agg.split(":")[0], "run": agg, "final_loss": math.nan,
                           "val_accuracy": math.nan, "loss_gap": math.nan, "acc_drop": math.nan,
                           "seconds": 0.0, "fails": [f"error: {type(err).__name__}: {err}"[:300]]}
                row.update(task=task, seed=seed)
                rows.append(row)
                vs_frozen = row.get("loss_gap_vs_frozen")
                vs_frozen = "" if vs_frozen is None else f"{vs_frozen:+.1%}"
                print(f"{task:12} {seed:4d} {agg:{width}} {row['final_loss']:10.4f} "
                      f"{row['loss_gap']:+8.1%} {vs_frozen:>9} {row['val_accuracy']:7.3f} "
                      f"{-row['acc_drop']:+6.3f}  {'; '.join(row['fails']) or 'ok'} "
                      f"({row['seconds']:.0f} s)", flush=True)
                save(args, extra, rows, {}, None)  # so far, in case the run is cut short
    failed = [r for r in rows if r["fails"]]
    worst = {}
    for r in rows:
        if r.get("reference") is None:
            # A run that failed to train (NaN: an error row) is the worst there is.
            w = worst.setdefault(r["run"], {"loss_gap": -math.inf, "acc_drop": -math.inf})
            for key in ("loss_gap", "acc_drop"):
                w[key] = math.nan if math.isnan(r[key]) or math.isnan(w[key]) \
                    else max(w[key], r[key])
    print("worst over tasks and seeds: " + ", ".join(
        f"{k} " + ("did not train" if math.isnan(v["loss_gap"]) else
                   f"loss {v['loss_gap']:+.1%} acc −{v['acc_drop']:.3f}")
        for k, v in worst.items()))
    lossy = sum(1 for r in rows if r.get("reference") is None)
    print(f"{len(failed)} of {lossy} lossy runs fail "
          f"(loss gap > {args.max_loss_gap:.0%}"
          + (", outside fp32's band" if band_seeds else "")
          + f" or accuracy drop > {args.max_acc_drop})")
    save(args, extra, rows, worst, len(failed))
    return 1 if failed else 0


def measure_band(rows, base, ref, init_seeds, extra, runtime, args, task, seed, width):
    """fp32's band for (task, seed): the reference run again with each of `init_seeds`
    as the model's initialisation, the task and batches of `seed`; rows added, printed."""
    spec = EXACT if args.reference == "exact" else "none"
    losses = [ref["final_loss"]]
    for init in init_seeds:
        if init == seed:
            continue
        row = run_one({**base, "seed": init}, spec, extra, runtime, args.smooth,
                      task_seed=seed)
        row.update(task=task, seed=seed, init_seed=init, reference="band", fails=[],
                   loss_gap=row["final_loss"] / ref["final_loss"] - 1,
                   acc_drop=ref["val_accuracy"] - row["val_accuracy"])
        rows.append(row)
        losses.append(row["final_loss"])
        print(f"{task:12} {seed:4d} {spec + ' init ' + str(init):{width}} "
              f"{row['final_loss']:10.4f} {row['loss_gap']:+8.1%} {'':>9} "
              f"{row['val_accuracy']:7.3f} {-row['acc_drop']:+6.3f}  fp32 band run "
              f"({row['seconds']:.0f} s)", flush=True)
    band = fp32_band(losses) if len(losses) > 1 else None
    rows.append({"task": task, "seed": seed, "reference": "band-summary", "run": spec,
                 "runs": len(losses), "init_seeds": [seed] + [i for i in init_seeds
                                                           if i != seed],
                 "final_losses": losses, "band": band, "fails": []})
    if band is not None:
        print(f"{task:12} {seed:4d} {'fp32 band':{width}} ±{band:.2%} over {len(losses)} "
              f"runs (init seeds {', '.join(map(str, rows[-1]['init_seeds']))}); lossy "
              "runs judged two-sided against it", flush=True)
    return band


def save(args, extra, rows, worst, failed):
    if not args.out:
        return
    bands = {f"{r['task']} seed {r['seed']}": {k: r[k] for k in (
        "band", "runs", "init_seeds", "final_losses")}
             for r in rows if r.get("reference") == "band-summary"}
    out = {"args": vars(args), "overrides": extra, "rows": rows, "worst": worst,
           "bands": bands, "failed": failed, "complete": failed is not None,
           "loadavg": _uptime()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def _uptime():
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
