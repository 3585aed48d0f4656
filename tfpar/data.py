"""Training data: generated tasks that really learn, or the user's own `tf.data` pipeline.

Every built-in task makes example `i` from a stateless RNG keyed by `(seed, i)`. Step `s`
of a run whose steps take `E` examples (global batch × accumulation steps) is examples
`s*E … s*E+E-1` whatever the number of replicas or workers; replica `r` takes its
contiguous slice. So a data-parallel run sees
exactly the batches a single device sees, and a run resumed at step `s` continues with the
batches the uninterrupted run would have seen.

Held-out data (`validation_steps`) are examples `-1, -2, …` of the same task: the training
stream uses indices >= 0 only, so it never reaches them. A user's `--dataset=module:function`
gives its own held-out batches as `module.function_validation(input_context, config)`.
"""

import dataclasses
import importlib
import inspect

import numpy as np
import tensorflow as tf

from tfpar.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Task:
    """A supervised task: how to make example `i`, and the shapes a model needs.

    `example_fn(i)` returns `(x, y)` or `(x, y, sample_weight)` for an int64 index `i`.
    """

    name: str
    input_shape: tuple
    num_classes: int
    example_fn: object = None
    user_fn: object = None  # `module:function` pipelines replace example_fn
    validation_fn: object = None  # `module:function_validation`, if validation_steps > 0


def teacher_task(seed, dim=32, classes=10, hidden=64):
    """Classification of Gaussian inputs by a fixed random two-layer 'teacher' network."""
    rng = np.random.RandomState(seed + 1)
    w1 = tf.constant((rng.randn(dim, hidden) / np.sqrt(dim)).astype("float32"))
    w2 = tf.constant((rng.randn(hidden, classes) / np.sqrt(hidden)).astype("float32"))

    def example(i):
        x = tf.random.stateless_normal([dim], seed=tf.stack([tf.cast(seed, tf.int64), i]))
        logits = tf.linalg.matvec(tf.transpose(w2), tf.nn.relu(tf.linalg.matvec(
            tf.transpose(w1), x)))
        return x, tf.argmax(logits, output_type=tf.int32)

    return Task("teacher", (dim,), classes, example)


def pattern_images_task(seed, size=16, classes=10, noise=0.8):
    """Images of one of `classes` fixed random colour patterns under heavy noise."""
    rng = np.random.RandomState(seed + 2)
    coarse = rng.randn(classes, size // 4, size // 4, 3).astype("float32")
    templates = tf.constant(np.repeat(np.repeat(coarse, 4, axis=1), 4, axis=2))

    def example(i):
        key = tf.stack([tf.cast(seed, tf.int64), i])
        label = tf.random.stateless_uniform([], key, maxval=classes, dtype=tf.int32)
        image = tf.gather(templates, label) + noise * tf.random.stateless_normal(
            [size, size, 3], seed=key + tf.constant([0, 1 << 40], tf.int64))
        return image, label

    return Task("pattern_images", (size, size, 3), classes, example)


def reverse_task(seed, length=8, vocab=16):
    """Sequence reversal as next-token prediction: `x SEP reverse(x)`, loss on the reversed
    half only (the first half is random and cannot be predicted)."""
    sep = vocab
    weights = tf.constant([0.0] * (length - 1) + [1.0] * (length + 1))

    def example(i):
        key = tf.stack([tf.cast(seed, tf.int64), i])
        x = tf.random.stateless_uniform([length], key, maxval=vocab, dtype=tf.int32)
        seq = tf.concat([x, [sep], tf.reverse(x, [0])], axis=0)
        return seq[:-1], seq[1:], weights

    return Task("reverse", (2 * length,), vocab + 1, example)


def lookup_task(seed, length=16, vocab=32):
    """Next token from a random table of the last two: `y_t = T[x_{t-1}, x_t]` for random
    tokens `x`, `T` a fixed random `vocab × vocab` table (from `seed`), no loss at `t = 0`.

    The transformer has to attend to the previous token and memorise the `vocab²` entries;
    a default-length run (200 steps of 64) learns a good part of the table but does not reach
    zero loss, so a slower aggregator shows as a higher final loss. (Reversal, the
    transformer's default task, reaches ~0.001 in 200 steps, where a relative gap is
    run-to-run noise.) Used by tools/bench_compression_quality.py.
    """
    table = tf.random.stateless_uniform([vocab, vocab], tf.stack([tf.cast(seed, tf.int64), -7]),
                                        maxval=vocab, dtype=tf.int32)
    weights = tf.constant([0.0] + [1.0] * (length - 1))

    def example(i):
        key = tf.stack([tf.cast(seed, tf.int64), i])
        x = tf.random.stateless_uniform([length], key, maxval=vocab, dtype=tf.int32)
        y = tf.gather_nd(table, tf.stack([tf.roll(x, 1, 0), x], axis=1))
        return x, y, weights

    return Task("lookup", (length,), vocab, example)


DEFAULT_TASKS = {"mlp": teacher_task, "convnet": pattern_images_task,
                 "transformer": reverse_task}


USER_PIPELINE = ("a function (input_context, config) -> tf.data.Dataset of per-replica "
                 "batches (x, y) or (x, y, sample_weight): x of shape [batch, ...], y integer "
                 "class ids of shape [batch] (or [batch, length] for a sequence model), batch "
                 "= config.per_replica_batch(input_context.num_replicas_in_sync)")


def make_task(config):
    """The task for `config`: the model's generated task, or the user's `module:function`.

    Raises:
        ConfigError: the user's function cannot be loaded, has the wrong signature or yields
            batches of the wrong structure or shape (one line saying what it must be).
    """
    if config.dataset == "auto":
        return DEFAULT_TASKS[config.model](config.seed)
    module_name, fn_name = config.dataset.split(":")
    try:
        module = importlib.import_module(module_name)
        fn = getattr(module, fn_name)
    except (ImportError, AttributeError) as err:
        raise ConfigError("dataset", config.dataset,
                          f"could not load it ({err}); give 'module:function' importable "
                          "from the working directory") from None
    if not config.num_classes:
        raise ConfigError("num_classes", 0, f"--dataset={config.dataset} needs --num_classes")
    spec = _user_spec("dataset", config.dataset, fn, config)
    validation_fn = None
    if getattr(config, "validation_steps", 0):
        validation_fn = getattr(module, f"{fn_name}_validation", None)
        if validation_fn is None:
            raise ConfigError("validation_steps", config.validation_steps,
                              f"--dataset={config.dataset} has no held-out data: define "
                              f"{module_name}.{fn_name}_validation(input_context, config) "
                              f"yielding batches like {fn_name}'s, or use "
                              "--validation_steps=0")
        _user_spec("dataset", f"{module_name}:{fn_name}_validation", validation_fn, config)
    return Task(config.dataset, tuple(spec[0].shape[1:]), config.num_classes, user_fn=fn,
                validation_fn=validation_fn)


def _user_spec(setting, name, fn, config):
    """The element spec of the user's pipeline `fn`, checked; else one `ConfigError` line."""
    def refuse(what):
        return ConfigError(setting, name, f"{what}; it must be {USER_PIPELINE}")

    try:
        inspect.signature(fn).bind(tf.distribute.InputContext(), config)
    except TypeError:
        raise refuse(f"its signature is {fn.__name__}{inspect.signature(fn)}") from None
    except ValueError:
        pass  # a builtin without a signature: call it and see
    dataset = fn(tf.distribute.InputContext(), config)
    if not isinstance(dataset, tf.data.Dataset):
        raise refuse(f"it returned a {type(dataset).__name__}")
    spec = dataset.element_spec
    if (not isinstance(spec, tuple) or len(spec) not in (2, 3)
            or not all(isinstance(s, tf.TensorSpec) for s in spec)):
        raise refuse(f"its elements are {spec}")
    x, y = spec[0].shape, spec[1].shape
    batch = config.per_replica_batch(1)
    if x.rank is None or x.rank < 2 or y.rank is None or y.rank not in (1, 2):
        raise refuse(f"its elements have x of shape {x} and y of shape {y} (not batched?)")
    if not spec[1].dtype.is_integer:
        raise refuse(f"its labels y are {spec[1].dtype.name}")
    sizes = {d for d in (x[0], y[0], *([spec[2].shape[0]] if len(spec) == 3 else []))
             if d is not None}
    if sizes - {batch}:
        raise refuse(f"its batches hold {sorted(sizes)} examples where one replica of "
                     f"global_batch_size={config.global_batch_size} takes {batch}")
    return spec


def pipeline_dataset(config, task, context, start_step=0):
    """The dataset one input pipeline (worker) feeds to its local replicas.

    Yields per-replica batches, replica after replica for each step, which is the order in
    which `distribute_datasets_from_function` hands them to the local replicas. Where the
    replicas do not divide the step's examples, each batch is padded to one size with
    examples of weight zero and the real ones are weighted so that the replicas' summed
    gradient is the whole batch's mean-loss gradient (`tfpar.replica_split`).
    """
    replicas = context.num_replicas_in_sync
    local = replicas // context.num_input_pipelines
    if task.user_fn is not None:
        config.per_replica_batch(replicas, "a --dataset function yields equal per-replica "
                                           "batches")
        ds = task.user_fn(context, config).repeat()
        return ds.skip(start_step * local).prefetch(tf.data.AUTOTUNE)
    # Each step a replica takes all its micro-batches at once (see tfpar.accumulation).
    split = config.replica_split(replicas)
    ds = _replica_batches(split, task.example_fn, context.input_pipeline_id * local, local,
                          start_step * local, (start_step + _huge_steps()) * local)
    # Never reached, but declared endless (tf.data's cardinality): across workers
    # tf.distribute otherwise makes the workers agree every step that none has run out
    # (one more all-reduce a step: `_enable_get_next_as_optional`).
    return ds.repeat().prefetch(tf.data.AUTOTUNE)


def _replica_batches(split, example_fn, first, local, begin, end):
    """Batches `begin … end-1` of this pipeline's `local` replicas (`first` the first of
    them), replica after replica per step: batch `k` is replica `first + k % local`'s share
    of step `k // local`, made by `example_fn(i)` for the step's example indices `i`."""
    if split.even and first == 0 and local == split.replicas:
        # One pipeline feeds every replica: batch k is examples k*padded … (k+1)*padded-1,
        # one range, no dataset made per batch (the flat_map below cost 4 % more CPU time
        # than stock Keras's input, this 2 %: docs/benchmarks/data_parallel.md).
        ds = tf.data.Dataset.range(begin * split.padded, end * split.padded)
        ds = ds.map(example_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.batch(split.padded, drop_remainder=True)
    if split.even:  # no padding, no weights added: the batches as they always were
        def replica_examples(k):
            step, replica = k // local, first + k % local
            start = step * split.examples + replica * split.padded
            return tf.data.Dataset.range(start, start + split.padded)

        ds = tf.data.Dataset.range(begin, end).flat_map(replica_examples)
        ds = ds.map(example_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.batch(split.padded, drop_remainder=True)
    counts = tf.constant(split.counts, tf.int64)
    offsets = tf.constant(split.offsets, tf.int64)

    def padded_examples(k):
        step, replica = k // local, first + k % local
        position = tf.range(split.padded, dtype=tf.int64)
        real = position < counts[replica]
        # Padding repeats the step's first example: it always exists, and weight 0.
        index = step * split.examples + tf.where(real, offsets[replica] + position, 0)
        weight = tf.where(real, tf.constant(split.weight, tf.float32), 0.0)
        return tf.data.Dataset.from_tensor_slices((index, weight))

    def weighted(index, weight):
        x, y, *sample_weight = example_fn(index)
        return x, y, weight * (sample_weight[0] if sample_weight else 1.0)

    ds = tf.data.Dataset.range(begin, end).flat_map(padded_examples)
    ds = ds.map(weighted, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.batch(split.padded, drop_remainder=True)


def _huge_steps():
    return 1 << 40  # effectively endless; fit is bounded by steps, not by data


def mesh_dataset(config, task, parts, start_step=0, validation=False):
    """Global batches for a mesh whose `batch` axis has `parts` shards, from `start_step`
    (held-out batches with `validation`): where `parts` does not divide the batch, the
    `parts` per-replica batches of `pipeline_dataset` (padded to one size, weighted as in
    `tfpar.replica_split`) placed end to end, so that the mesh's equal shards are exactly
    those replicas' batches; with accumulation or a pipeline's micro-batches
    (`split.microsteps`), micro-batch i of every replica, in turn, so that each of the
    equal cuts the step makes holds every replica's micro-batch i.

    The mesh step reduces the loss over the whole (padded) batch, `sum(w·loss) / (padded·R)`
    (Keras's `sum_over_batch_size`), the sum the tf.distribute replicas' gradients make:
    the same weights give the global batch's mean-loss gradient."""
    split = config.replica_split(parts, accumulated=not validation)
    if split.even or task.user_fn is not None:  # a --dataset function: whole batches
        if validation:
            return validation_dataset(config, task, tf.distribute.InputContext())
        return pipeline_dataset(config, task, tf.distribute.InputContext(), start_step)
    context = tf.distribute.InputContext(1, 0, parts)
    if validation:
        ds = validation_dataset(config, task, context)
    else:
        ds = pipeline_dataset(config, task, context, start_step)
    micro = split.microsteps

    def whole(*arrays):
        # [parts, padded, ...] -> [micro, parts, padded/micro, ...] -> one batch
        out = []
        for array in arrays:
            rest = tf.shape(array)[2:]
            cut = tf.reshape(array, tf.concat([[parts, micro, -1], rest], 0))
            perm = [1, 0, 2] + list(range(3, array.shape.rank + 1))
            out.append(tf.reshape(tf.transpose(cut, perm), tf.concat([[-1], rest], 0)))
        return tuple(out)

    return ds.batch(parts, drop_remainder=True).map(whole)


def distributed_dataset(strategy, config, task, start_step=0):
    """The training data for `strategy`, starting at `start_step`.

    Under `MirroredStrategy` (one process, one input pipeline for every replica) with a
    generated task whose step splits evenly, the pipeline is stock Keras's: whole steps'
    batches (`global_batch_pipeline`), which tf.distribute cuts into the replicas' equal,
    consecutive shares, the batches `pipeline_dataset` makes replica by replica. Fed
    replica by replica instead, the MLP's whole step took ~6 % more CPU time (4
    replicas; docs/benchmarks/data_parallel.md); a pipeline across workers with replicas
    (its chief's `MirroredStrategy`) takes this path too. Elsewhere
    (`MultiWorkerMirroredStrategy`, a `--dataset` function, padded shares) each input
    pipeline makes its replicas' batches.
    """
    split = config.replica_split(strategy.num_replicas_in_sync)
    if (isinstance(strategy, tf.distribute.MirroredStrategy) and split.even
            and task.user_fn is None):
        return strategy.experimental_distribute_dataset(
            global_batch_pipeline(config, task, start_step))
    return strategy.distribute_datasets_from_function(
        lambda context: pipeline_dataset(config, task, context, start_step))


def global_batch_pipeline(config, task, start_step=0):
    """Whole steps' examples from `start_step` on, a batch a step (global batch ×
    accumulation steps: example `s*E … s*E+E-1` for step `s`), as a user's `tf.data`
    pipeline for `fit` under a strategy makes them: `range → map → batch → prefetch`."""
    examples = config.effective_batch_size
    ds = tf.data.Dataset.range(start_step * examples, (start_step + _huge_steps()) * examples)
    ds = ds.map(task.example_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.batch(examples, drop_remainder=True).repeat().prefetch(tf.data.AUTOTUNE)


def validation_dataset(config, task, context):
    """`config.validation_steps` steps of held-out batches for one input pipeline (as
    `pipeline_dataset` orders them), repeated: every evaluation starts a new iterator and
    sees the same examples (an exhausted finite dataset would end Keras's next evaluation
    with StopIteration, because fit keeps its evaluation iterator between epochs). No
    `cache()`: iterators sharing one in-memory cache, one of them abandoned part-way, were
    seen to start later evaluations at other batches; the examples are cheap to regenerate."""
    local = context.num_replicas_in_sync // context.num_input_pipelines
    count = config.validation_steps * local
    if task.validation_fn is not None:
        return task.validation_fn(context, config).take(count).repeat()
    split = config.replica_split(context.num_replicas_in_sync, accumulated=False)
    ds = _replica_batches(split, lambda i: task.example_fn(-1 - i),  # indices training
                          context.input_pipeline_id * local, local, 0, count)  # never reaches
    return ds.repeat()


def distributed_validation(strategy, config, task):
    """`validation_dataset` for every input pipeline of `strategy`."""
    return strategy.distribute_datasets_from_function(
        lambda context: validation_dataset(config, task, context))


def global_batches(config, task, start_step, count):
    """`count` whole steps' batches starting at `start_step`, as numpy arrays (the single
    device's view of the same data; used by tests and the doctor)."""
    ds = pipeline_dataset(config, task, tf.distribute.InputContext(), start_step).take(count)
    return [tuple(np.asarray(t) for t in batch) for batch in ds]
