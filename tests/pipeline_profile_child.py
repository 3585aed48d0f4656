"""Child of tests/test_pipeline_timeline.py: the real profiler path of the measured bubble
(`tfpar.pipeline.timeline.profile`) on a small pipeline, printed as one JSON line.

2 stages on 2 logical CPUs (one op thread each, as bench_pipeline runs them), 4 Dense(512)
blocks, batch 256 (big enough that compute, not per-op dispatch, fills a step). Per
schedule and M: the profiled bubble, the theory (K-1)/(M+K-1), and the actions the profile
found per stage.

    python tests/pipeline_profile_child.py gpipe:1 1f1b:4
"""

import json
import sys

import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

from tfpar.devices import split_cpu  # noqa: E402

split_cpu(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfpar.pipeline import timeline  # noqa: E402
from tfpar.pipeline.executor import PipelineExecutor, default_devices  # noqa: E402
from tfpar.pipeline.partition import partition  # noqa: E402
from tfpar.pipeline.schedule import make_schedule, theory_bubble  # noqa: E402

K, WIDTH, BATCH = 2, 512, 256
rng = np.random.default_rng(0)
x = tf.constant(rng.normal(size=(BATCH, WIDTH)).astype("float32"))
y = tf.constant(rng.normal(size=(BATCH, WIDTH)).astype("float32"))
devices = default_devices(K)
out = {}
for spec in sys.argv[1:]:
    name, M = spec.split(":")
    M = int(M)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((WIDTH,))] + [
        keras.layers.Dense(WIDTH, activation="relu") for _ in range(4)])
    ex = PipelineExecutor(partition(model, K, devices=devices), devices,
                          make_schedule(name, K, M, 1), keras.losses.MeanSquaredError())
    ex.build_optimizers(keras.optimizers.SGD(1e-3))
    step = tf.function(ex.train_step, jit_compile=False)
    run = lambda: step(x, y)[0].numpy()  # noqa: E731
    for _ in range(3):  # trace and warm up
        run()
    bubbles, actions = [], None
    for _ in range(9):  # the median of nine profiled steps
        tl = timeline.profile(run, K)
        bubbles.append(tl.bubble)
        actions = [sorted(a[0] for a in row) for row in tl.actions]
    out[spec] = {"bubble": float(np.median(bubbles)), "bubbles": bubbles,
                 "theory": theory_bubble(K, M, 1), "actions": actions}
print(json.dumps(out), flush=True)
