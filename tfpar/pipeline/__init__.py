"""Pipeline parallelism: schedules as data, stage split, executor, `PipelineModel`.

`tfpar.pipeline.schedule` is pure Python; the other modules import TensorFlow, so they are
imported on first use rather than here (`tfpar.pipeline.for_training` included).
"""


def __getattr__(name):
    if name == "for_training":
        from tfpar.pipeline.training import for_training
        return for_training
    raise AttributeError(f"module 'tfpar.pipeline' has no attribute {name!r}")
