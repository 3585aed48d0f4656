"""What each side of a benchmark against a PyTorch peer ran with: processes, and threads
per process.

The peers (`../shared/peers/`) run every rank with one thread (`torch.set_num_threads`);
tfpar's side runs with the TensorFlow thread settings its tool configured, read back by
`tensorflow_threads` in the process that runs TensorFlow. `resources_line` is the line each
table prints, from the same dicts its JSON holds under `"resources"`.
"""

import os

THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS")


def tensorflow_threads():
    """This process's TensorFlow thread settings as configured: `intra_op` and `inter_op`
    (`tf.config.threading`; 0 = TensorFlow picks), the environment variables that set
    them where set (`env`), and `cpus`, the CPUs this process may run on."""
    import tensorflow as tf
    return {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
            "env": {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ},
            "cpus": len(os.sched_getaffinity(0))}


def tensorflow_side(processes, threads, what=""):
    """The `"resources"` entry of a tfpar side: `processes` running TensorFlow with
    `threads` (a `tensorflow_threads()` dict, or None when the run did not record it)."""
    return {"processes": processes, "tensorflow_threads": threads, "what": what}


def torch_side(processes, threads, what=""):
    """The `"resources"` entry of a PyTorch side: `processes` ranks, each with
    `torch.set_num_threads(threads)` (None: not known)."""
    return {"processes": processes, "torch_threads": threads, "what": what}


def describe(side):
    """One side's resources in words, e.g. `2 processes x TensorFlow intra-op 0, inter-op 0
    (0: TensorFlow picks), 2 CPUs visible each`."""
    n = side["processes"]
    head = f"{n} process{'es' if n != 1 else ''}"
    if "torch_threads" in side:
        threads = side["torch_threads"]
        body = (f"{threads} thread{'s' if threads != 1 else ''} each (torch.set_num_threads)"
                if threads is not None else "threads not recorded")
    else:
        t = side["tensorflow_threads"]
        if t is None:
            body = "TensorFlow threads not recorded"
        else:
            zero = " (0: TensorFlow picks)" if 0 in (t["intra_op"], t["inter_op"]) else ""
            env = "".join(f", {k}={v}" for k, v in sorted(t["env"].items()))
            body = (f"TensorFlow intra-op {t['intra_op']}, inter-op {t['inter_op']}{zero}"
                    f"{env}, {t['cpus']} CPUs visible each")
    return f"{head} x {body}" + (f" [{side['what']}]" if side.get("what") else "")


def resources_line(sides):
    """`resources: NAME: ...; NAME: ...` for `{name: side or [side, ...]}` (a list: the
    distinct entries of several runs, joined by ` / `); tables print it under their
    header."""
    def words(entry):
        return " / ".join(map(describe, entry)) if isinstance(entry, list) else describe(entry)
    return "resources: " + "; ".join(f"{name}: {words(e)}" for name, e in sides.items())


def distinct(entries):
    """The distinct entries of `entries` (dicts), in order of first appearance."""
    out = []
    for entry in entries:
        if entry not in out:
            out.append(entry)
    return out
