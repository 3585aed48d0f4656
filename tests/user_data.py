"""A user's own input pipeline, as `--dataset=user_data:sign_of_sum` would load it."""

import tensorflow as tf


def sign_of_sum(input_context, config):
    """Per-replica batches of (x, y): y = 1 where the features sum above zero."""
    batch = config.per_replica_batch(input_context.num_replicas_in_sync)
    ds = tf.data.Dataset.range(1 << 30).map(
        lambda i: tf.random.stateless_normal([8], seed=tf.stack([i, 7])))
    ds = ds.map(lambda x: (x, tf.cast(tf.reduce_sum(x) > 0, tf.int32)))
    return ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id).batch(
        batch, drop_remainder=True)


def sign_of_sum_alike_on_replicas(input_context, config):
    """As `sign_of_sum`, but every replica of a step gets the same batch (its first
    replica's): replicas' own gradients, and so state kept per replica, are alike."""
    local = input_context.num_replicas_in_sync // input_context.num_input_pipelines
    return sign_of_sum(input_context, config).flat_map(
        lambda x, y: tf.data.Dataset.from_tensors((x, y)).repeat(local))


def sign_of_sum_nan_at_step_3(input_context, config):
    """As `sign_of_sum`, but replica 0's batch of step 3 holds a NaN (a corrupt record)."""
    local = input_context.num_replicas_in_sync // input_context.num_input_pipelines
    ds = sign_of_sum(input_context, config).enumerate()
    poison = 3 * local if input_context.input_pipeline_id == 0 else -1
    return ds.map(lambda i, xy: (tf.where(i == poison, float("nan"), xy[0]), xy[1]))


def sign_of_sum_overflow_on_worker_1(input_context, config):
    """As `sign_of_sum`, but worker 1's first batch holds a value that overflows fp16."""
    ds = sign_of_sum(input_context, config).enumerate()
    poison = 0 if input_context.input_pipeline_id == 1 else -1
    return ds.map(lambda i, xy: (tf.where(i == poison, 6e4 * xy[0], xy[0]), xy[1]))


def sign_of_sum_fp16_overflow_at_step_3(input_context, config):
    """As `sign_of_sum`, but replica 0's batch of step 3 is 1000 times larger: a finite
    fp16 forward pass whose loss-scaled gradients overflow fp16 (a skipped step)."""
    local = input_context.num_replicas_in_sync // input_context.num_input_pipelines
    ds = sign_of_sum(input_context, config).enumerate()
    poison = 3 * local if input_context.input_pipeline_id == 0 else -1
    return ds.map(lambda i, xy: (tf.where(i == poison, 1e3 * xy[0], xy[0]), xy[1]))


def sign_of_sum_validation(input_context, config):
    """Held-out batches for `--dataset=user_data:sign_of_sum --validation_steps=N`: the
    same task on examples the training stream (indices from 0 up) never reaches."""
    batch = config.per_replica_batch(input_context.num_replicas_in_sync)
    ds = tf.data.Dataset.range(1 << 30).map(
        lambda i: tf.random.stateless_normal([8], seed=tf.stack([-1 - i, 7])))
    ds = ds.map(lambda x: (x, tf.cast(tf.reduce_sum(x) > 0, tf.int32)))
    return ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id).batch(
        batch, drop_remainder=True)


# Pipelines a user gets wrong (tests/test_library.py): each is one clear error line.

def takes_only_config(config):
    return sign_of_sum(tf.distribute.InputContext(), config)


def returns_a_list(input_context, config):
    return [1, 2, 3]


def unbatched(input_context, config):
    return sign_of_sum(input_context, config).unbatch()


def float_labels(input_context, config):
    return sign_of_sum(input_context, config).map(lambda x, y: (x, tf.cast(y, tf.float32)))


def global_batches(input_context, config):
    """Batches of the whole global batch twice over, whatever the replicas."""
    return sign_of_sum(input_context, config).unbatch().batch(2 * config.global_batch_size,
                                                              drop_remainder=True)
