"""The PyTorch pipeline peer's model and batch, built in Keras for the pipeline benchmarks.

`tools/bench_pipeline_peer.py` and `tools/bench_pipeline_overhead.py` both measure this
model (the one `shared/peers/torch_pipeline.py` trains): 8 × Dense(1024, relu) and a
16-class head, global batch 2048, K=2 stages. One module, so the two tools cannot drift
apart (each defines its own absl flags, so neither can import the other).
"""

WIDTH, BLOCKS, CLASSES, BATCH, K = 1024, 8, 16, 2048, 2


def model(keras):
    """The peer's MLP with seed 0."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((WIDTH,))]
        + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(BLOCKS)]
        + [keras.layers.Dense(CLASSES)], name="peer_mlp")


def batch(np):
    """One global batch (x float32 [BATCH, WIDTH], y int32 [BATCH]) whose labels a small
    random ReLU network gives, so the task can be learnt."""
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(BATCH, WIDTH)).astype("float32")
    w1 = rng.normal(size=(WIDTH, 256)) / WIDTH ** 0.5
    w2 = rng.normal(size=(256, CLASSES)) / 256 ** 0.5
    y = np.argmax(np.maximum(x @ w1, 0) @ w2, axis=1).astype("int32")
    return x, y
