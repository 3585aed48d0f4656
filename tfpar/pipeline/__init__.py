"""Pipeline parallelism: schedules as data, stage split, executor, `PipelineModel`.

`tfpar.pipeline.schedule` is pure Python; the other modules import TensorFlow, so they are
imported on first use rather than here.
"""
