"""tfpar's pipeline against torch.distributed.pipelining on the peer's model, in one sitting.

    python tools/bench_pipeline_peer.py --torch_python=$HOME/.venvs/torch-peer/bin/python \\
        --microbatches=4,8,16 --rounds=3 --json=runs/pipeline_peer.json

The model is the peer's (`../shared/peers/torch_pipeline.py`): 8 x Dense(1024, relu) and a
Dense(16) head, sparse cross-entropy on a fixed random teacher's labels, SGD momentum 0.9
(lr 0.05), global batch 2048, K=2 stages on 2 logical CPUs. tfpar runs every schedule in one
process with one intra-op thread per op, so that each stage occupies one core as the peer's
two single-threaded ranks do. The references are the same model unpipelined on the full
batch: tfpar in a child process with TensorFlow's own thread pools, the peer with 1 and 2
threads. The table's `resources:` line and the JSON's `resources` state each side's
processes and threads (tfpar's read back from TensorFlow in the process that ran it).

Rounds alternate: tfpar's unpipelined reference, all tfpar configurations, then the peer's
whole run (`--peer_schedules`, its own references included), so that a change in the
machine's speed falls on both. Per configuration the table gives the median over rounds of
each round's median step (tfpar: `--steps` timed steps after two untimed; the peer: its own
median, max over ranks) and the spread [min-max] of those round medians, and per M the best
schedule of each side and their ratio (tfpar / torch: below 1 means tfpar is faster; per
round the ratio of the two best is also given, as min-max). The 1-minute load average is
recorded at the start and end of every round.

Output: the table, and with --json {"benchmark": "pipeline_peer", "runs": [...], "rounds":
[...]}, each tfpar run in the metrics-JSON shape (config, strategy, replicas, workers,
steps, final_loss, examples_per_sec, step_time_ms, pipeline).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

import peer_mlp
import side_resources
from peer_mlp import BATCH, K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FLAGS = flags.FLAGS
flags.DEFINE_list("microbatches", ["4", "8", "16"], "micro-batch counts M")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved", "zb_h1"], "tfpar schedules")
flags.DEFINE_list("peer_schedules", ["GPipe", "1F1B", "Interleaved1F1B",
                                     "InterleavedZeroBubble", "ZBVZeroBubble"],
                  "torch.distributed.pipelining schedules (the peer's names)")
flags.DEFINE_integer("steps", 6, "timed steps per configuration and round")
flags.DEFINE_integer("rounds", 3, "rounds of (tfpar, peer)")
flags.DEFINE_string("torch_python", os.path.expanduser("~/.venvs/torch-peer/bin/python"),
                    "the peer's python (its own virtual environment); '' = tfpar only")
flags.DEFINE_string("peer_script", os.path.join(ROOT, "..", "shared", "peers",
                                                "torch_pipeline.py"), "the peer benchmark")
flags.DEFINE_string("json", "", "write the results here")
flags.DEFINE_bool("one_op_at_a_time", False, "each stage runs its ops one at a time "
                  "(PipelineExecutor's one_op_at_a_time)")
flags.DEFINE_bool("child_reference", False, "internal: run the unpipelined tfpar step")


# The peer's side, from its code (`torch_pipeline.py` records no thread count): each
# pipeline rank calls torch.set_num_threads(1) (with OMP_NUM_THREADS=1); its unpipelined
# references run in its main process with 1 and with 2 threads (their keys name them).
PEER_RESOURCES = {
    "torch": side_resources.torch_side(K, 1, "every schedule, one stage per rank"),
    "torch unpipelined": [side_resources.torch_side(1, 1, "reference"),
                          side_resources.torch_side(1, 2, "reference")]}


def _times(fn, steps):
    fn()
    fn()  # trace, warm up
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _reference_child():
    """The unpipelined step with TensorFlow's default thread pools; prints its times."""
    import keras
    import numpy as np
    import tensorflow as tf
    x, y = (tf.constant(a) for a in peer_mlp.batch(np))
    model = peer_mlp.model(keras)
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt.build(model.trainable_variables)

    @tf.function(jit_compile=False)
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    print(json.dumps({"times": _times(lambda: step().numpy(), FLAGS.steps),
                      "threads": side_resources.tensorflow_threads()}), flush=True)


def _build_tfpar(Ms):
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(K)
    from tfpar.devices import split_cpu
    split_cpu(K)
    import keras
    import numpy as np
    from tfpar.pipeline.executor import PipelineExecutor, default_devices
    from tfpar.pipeline.partition import partition
    from tfpar.pipeline.schedule import make_schedule
    x, y = (tf.constant(a) for a in peer_mlp.batch(np))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    devices = default_devices(K)
    configs, meta = {}, {}
    for name in FLAGS.schedules:
        V = 2 if name == "interleaved" else 1
        for M in Ms:
            if name == "interleaved" and M % K:
                continue
            stages = partition(peer_mlp.model(keras), K * V,
                               devices=[devices[v % K] for v in range(K * V)])
            ex = PipelineExecutor(stages, devices, make_schedule(name, K, M, V), loss_fn,
                                  one_op_at_a_time=FLAGS.one_op_at_a_time)
            ex.build_optimizers(keras.optimizers.SGD(0.05, momentum=0.9))
            step = tf.function(ex.train_step, jit_compile=False)
            key = f"{name}:{M}"
            configs[key] = lambda step=step: step(x, y)[0].numpy()
            meta[key] = (name, M, V)
    return configs, meta


def _peer_round(Ms):
    """One run of the peer over its schedules; returns {name: seconds} (median step)."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="peer_")
    os.close(fd)
    cmd = [FLAGS.torch_python, FLAGS.peer_script, "--steps", str(FLAGS.steps), "--json", path,
           "--schedules", *FLAGS.peer_schedules, "--microbatches", *map(str, Ms)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"the peer failed ({out.returncode}): {out.stderr[-2000:]}")
    with open(path) as f:
        data = json.load(f)
    os.unlink(path)
    result = {f"{r['schedule']}:{r['M']}": r["step_median"] for r in data["rows"] if r["ok"]}
    result["unpipelined:1thread"] = data["unpipelined_1thread"]
    result["unpipelined:2threads"] = data["unpipelined_2threads"]
    return result


def _reference_round():
    """tfpar's unpipelined step in a child process (TensorFlow's own thread pools):
    `(median seconds, its tensorflow_threads())`."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child_reference",
                          f"--steps={FLAGS.steps}"], capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"the unpipelined reference failed: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return statistics.median(got["times"]), got["threads"]


def _fmt(values):
    """'median [min-max]' of a list of seconds, or '-'."""
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main(argv):
    del argv
    if FLAGS.child_reference:
        return _reference_child()
    Ms = sorted(set(map(int, FLAGS.microbatches)))
    peer = bool(FLAGS.torch_python)
    if peer and not os.path.exists(FLAGS.torch_python):
        raise app.UsageError(f"--torch_python={FLAGS.torch_python} does not exist; install the "
                             "peer as ../shared/peers/README.md says, or pass --torch_python=''")
    configs, meta = _build_tfpar(Ms)
    resources = {"tfpar": side_resources.tensorflow_side(
        1, side_resources.tensorflow_threads(), f"every schedule, {K} logical CPUs")}
    if peer:
        resources.update(PEER_RESOURCES)
    rounds = []
    for r in range(FLAGS.rounds):
        load = os.getloadavg()[0]
        reference, threads = _reference_round()
        resources["tfpar unpipelined"] = side_resources.tensorflow_side(
            1, threads, "a child process, full batch")
        ours = {"unpipelined:tf_threads": reference}
        ours.update({k: statistics.median(_times(fn, FLAGS.steps)) for k, fn in configs.items()})
        theirs = _peer_round(Ms) if peer else {}
        rounds.append({"round": r, "load_1min": load, "load_1min_end": os.getloadavg()[0],
                       "tfpar": ours, "torch": theirs})
        print(f"round {r}: load {load:.2f} -> {rounds[-1]['load_1min_end']:.2f}; tfpar "
              f"{len(ours)} and torch {len(theirs)} configurations timed; "
              + json.dumps({k: round(v, 4) for side in (ours, theirs) for k, v in side.items()}),
              file=sys.stderr, flush=True)  # kept if a later round is cut by a timeout

    def values(side, key):
        return [rd[side][key] for rd in rounds if key in rd[side]]

    def median_over(side, key):
        v = values(side, key)
        return statistics.median(v) if v else None

    print(f"8 x Dense(1024) + head, batch {BATCH}, K={K}, one_op_at_a_time="
          f"{FLAGS.one_op_at_a_time}, {FLAGS.steps} steps x "
          f"{FLAGS.rounds} rounds; s/step as median [min-max] over rounds of each round's "
          f"median; load (1 min) at round start/end "
          f"{[(round(r['load_1min'], 2), round(r['load_1min_end'], 2)) for r in rounds]}")
    print(side_resources.resources_line(resources))
    print(f"unpipelined: tfpar (TF's threads) {_fmt(values('tfpar', 'unpipelined:tf_threads'))}"
          + (f"; torch 1 thread {_fmt(values('torch', 'unpipelined:1thread'))}, "
             f"2 threads {_fmt(values('torch', 'unpipelined:2threads'))}" if peer else ""))
    print(f"{'M':>3}  {'tfpar schedule':<14}{'s/step [spread]':>24}   {'torch schedule':<22}"
          f"{'s/step [spread]':>24}{'tfpar/torch':>12}{'per round':>13}")
    runs, summary = [], []
    for M in Ms:
        ours = {meta[k][0]: median_over("tfpar", k) for k in configs if meta[k][1] == M}
        theirs = {s: median_over("torch", f"{s}:{M}") for s in FLAGS.peer_schedules}
        theirs = {s: t for s, t in theirs.items() if t is not None}
        for name, t in sorted(ours.items(), key=lambda kv: kv[1]):
            runs.append({"config": {"schedule": name, "stages": K, "microbatches": M,
                                    "model": "peer_mlp", "global_batch_size": BATCH},
                         "strategy": "pipeline", "replicas": 1, "workers": 1,
                         "steps": FLAGS.steps, "rounds": FLAGS.rounds,
                         "examples_per_sec": BATCH / t,
                         "step_time_ms": {"median": 1e3 * t,
                                          "rounds": [1e3 * v for v in
                                                     values("tfpar", f"{name}:{M}")]},
                         "pipeline": {"stages": K, "microbatches": M, "schedule": name}})
        best = min(ours, key=ours.get)
        peer_best = min(theirs, key=theirs.get) if theirs else None
        ratio = ours[best] / theirs[peer_best] if peer_best else None
        # Per round: tfpar's best over torch's best in that same round.
        per_round = []
        for rd in rounds:
            a = [rd["tfpar"][k] for k in configs if meta[k][1] == M]
            b = [rd["torch"][f"{s}:{M}"] for s in FLAGS.peer_schedules
                 if f"{s}:{M}" in rd["torch"]]
            if a and b:
                per_round.append(min(a) / min(b))
        summary.append({"microbatches": M, "tfpar_best": best, "tfpar_s": ours[best],
                        "tfpar_rounds": values("tfpar", f"{best}:{M}"),
                        "torch_best": peer_best, "torch_s": theirs.get(peer_best),
                        "torch_rounds": values("torch", f"{peer_best}:{M}") if peer_best else [],
                        "ratio": ratio, "ratio_per_round": per_round})
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "-"
        print(f"{M:>3}  {best:<14}{_fmt(values('tfpar', f'{best}:{M}')):>24}   "
              f"{peer_best or '-':<22}"
              f"{_fmt(values('torch', f'{peer_best}:{M}')) if peer_best else '-':>24}"
              f"{ratio if ratio is not None else float('nan'):>12.2f}{spread:>13}")
        for name in sorted(ours, key=ours.get)[1:]:
            print(f"{'':>3}  {name:<14}{_fmt(values('tfpar', f'{name}:{M}')):>24}")
        for name in sorted(theirs, key=theirs.get)[1:]:
            print(f"{'':>3}  {'':<14}{'':>24}   {name:<22}"
                  f"{_fmt(values('torch', f'{name}:{M}')):>24}")
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump({"benchmark": "pipeline_peer", "resources": resources,
                       "unpipelined_tfpar_s": median_over("tfpar", "unpipelined:tf_threads"),
                       "summary": summary, "runs": runs, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here or in any child (they inherit it).
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    app.run(main)
