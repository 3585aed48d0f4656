"""How to run a planned layout: whether `python -m tfpar.train` runs it today, its
command, and the Python calls that train it on the user's own model."""


def runnable(c, hw, request):
    """None when `python -m tfpar.train` runs layout `c` today, else why not: the layout's
    settings go through `ParallelConfig` and `compat.check_inputs` (with a `TF_CONFIG` of
    the planned hosts when the layout spans machines),
    the trainer's own rulebook (`tfpar.compat`), so the planner never offers what the
    trainer refuses."""
    from tfpar import compat
    from tfpar.config import MODELS, ParallelConfig
    from tfpar.errors import ConfigError

    if hw.machines > 1 and (c.tensor > 1 or c.pipeline > 1):
        return ("tfpar.train runs tensor and pipeline parallelism inside one machine; across "
                f"{hw.machines} machines only data parallelism")
    batch, accum = _batch_and_accumulation(c.pipeline, c.microbatches, request)
    try:
        several = {"strategy": "multi_worker"} if hw.machines > 1 else {}
        compat.check_inputs(ParallelConfig(**several,
            model=request.model if request.model in MODELS else "transformer",
            global_batch_size=batch, grad_accum_steps=accum, data_parallel=c.data,
            tensor_parallel=c.tensor, pipeline_stages=c.pipeline,
            microbatches=c.microbatches if c.pipeline > 1 else 1,
            schedule=c.schedule if c.pipeline > 1 else "1f1b", allreduce=c.allreduce,
            virtual_stages=c.virtual, compression=c.compression,
            mixed_precision=request.mixed_precision, optimizer=request.optimizer,
            recompute="blocks" if c.recompute else "none", zero_stage=c.zero,
            cpu_devices=hw.devices if request.simulated_cpu else 0), _cluster(hw))
    except ConfigError as err:
        return str(err)
    return None


def _cluster(hw):
    """The parsed `TF_CONFIG` of a worker per device on `hw`'s machines (None on one):
    what the rulebook's cluster rows (`--allreduce=hierarchical`'s hosts) read."""
    from tfpar import tf_config
    if hw.machines == 1:
        return None
    return tf_config.parse(tf_config.make(
        [f"host{d // hw.per_machine}:{23456 + d}" for d in range(hw.devices)], 0))


def _batch_and_accumulation(pipeline, microbatches, request):
    """`(global_batch_size, grad_accum_steps)` of the trainer's command: micro-batches
    without a pipeline are gradient accumulation."""
    if pipeline == 1 and microbatches > 1:
        return request.global_batch_size // microbatches, microbatches
    return request.global_batch_size, 1


def attach(row, request, hw):
    row["command"] = command(row, request, hw) if row["runnable"] is None and \
        request.trainer_builds_it else None
    row["python"] = python_calls(row, request, hw) if row["runnable"] is None else []


def command(row, request, hw):
    """The `python -m tfpar.train` command for `row` (runnable only if `row["runnable"]`
    is None and the trainer builds the model)."""
    batch, accum = _batch_and_accumulation(row["pipeline"], row["microbatches"], request)
    parts = ["python -m tfpar.train", f"--model={request.model}",
             f"--global_batch_size={batch}"]
    if request.model_width:
        parts.append(f"--model_width={request.model_width}")
    if request.model_depth:
        parts.append(f"--model_depth={request.model_depth}")
    if request.optimizer != "adam":
        parts.append(f"--optimizer={request.optimizer}")
    if request.mixed_precision != "none":
        parts.append(f"--mixed_precision={request.mixed_precision}")
    if request.simulated_cpu:
        parts.append(f"--cpu_devices={hw.devices}")
    if hw.machines > 1:
        parts.append("--strategy=multi_worker")
    parts.append(f"--data_parallel={row['data']}")
    if row["tensor"] > 1:
        parts.append(f"--tensor_parallel={row['tensor']}")
    if row["pipeline"] > 1:
        parts += [f"--pipeline_stages={row['pipeline']}", f"--microbatches={row['microbatches']}",
                  f"--schedule={row['schedule']}"]
        if row["virtual"] > 1:
            parts.append(f"--virtual_stages={row['virtual']}")
    if accum > 1:
        parts.append(f"--grad_accum_steps={accum}")
    if row["compression"] != "none":
        parts.append(f"--compression={row['compression']}")
    if hw.machines > 1 and row["data"] > 1:  # the planner's choice, not `auto`'s
        parts.append(f"--allreduce={row['allreduce']}")
    if row["recompute"]:
        parts.append("--recompute=blocks")
    if row["zero"]:
        parts.append(f"--zero_stage={row['zero']}")
    text = " ".join(parts)
    if hw.machines > 1:
        text += f"    # on each of the {hw.machines} machines, TF_CONFIG naming all"
    return text


def python_calls(row, request, hw):
    """Lines of Python that train `row`'s layout on the user's own model (`build()` stands
    for the user's function; `loss`, `dataset` for theirs)."""
    build = (f"{request.model.split(':')[1]}()" if ":" in request.model else "build()")
    if row["recompute"]:  # the user's model has no zoo block names: every layer
        build = f"tfpar.recompute.every_layer({build})"
    if ":" in request.model:
        head = [f"from {request.model.split(':')[0]} import {request.model.split(':')[1]}"]
    else:
        head = ["build = ...  # your function returning the Keras model"]
    config = [f"global_batch_size={request.global_batch_size}",
              f"data_parallel={row['data']}", f"tensor_parallel={row['tensor']}",
              f"pipeline_stages={row['pipeline']}"]
    if row["pipeline"] > 1:
        config += [f"microbatches={row['microbatches']}", f"schedule={row['schedule']!r}"]
        if row["virtual"] > 1:
            config.append(f"virtual_stages={row['virtual']}")
    if row["compression"] != "none":
        config.append(f"compression={row['compression']!r}")
    if hw.machines > 1 and row["data"] > 1:
        config.append(f"allreduce={row['allreduce']!r}")
    if row["zero"]:
        config.append(f"zero_stage={row['zero']}")
    if request.simulated_cpu:
        config.append(f"cpu_devices={hw.devices}")
    optimizer = {"adam": "keras.optimizers.Adam()", "sgd": "keras.optimizers.SGD()",
                 "momentum": "keras.optimizers.SGD(momentum=0.9)"}[request.optimizer]
    lines = head + ["import keras", "import tfpar",
                    f"config = tfpar.ParallelConfig({', '.join(config)})"]
    if request.simulated_cpu:
        lines += ["from tfpar import devices",
                  "devices.split_cpu(config.cpu_devices)  # before TensorFlow initialises"]
    if row["tensor"] > 1:
        lines += [
            "from tfpar.layout import mesh, presets, trainer",
            f"m = mesh.make_mesh({row['data']}, {row['tensor']})",
            "model, fitter = trainer.build_on_mesh(m, presets.preset_rules(list(presets.PRESETS)),",
            f"    lambda: {build}, lambda: {optimizer}, loss"
            + (f", compression={row['compression']!r})" if row["compression"] != "none"
               else ")"),
            "fitter.fit(batches, steps_per_epoch=...)  # batches of the global batch"]
    elif row["pipeline"] > 1:
        lines += [
            "from tfpar import strategy",
            "from tfpar.pipeline import for_training",
            "runtime = strategy.make_runtime(config)  # one machine: its devices hold the stages",
            "with runtime.strategy.scope():",
            f"    model = for_training({build}, config, runtime)",
            f"    model.compile(optimizer={optimizer}, loss=loss)",
            f"model.fit(dataset)  # batches of {request.global_batch_size}"]
    else:
        lines += ["from tfpar import strategy",
                  "runtime = strategy.make_runtime(config)  # MultiWorkerMirrored under TF_CONFIG",
                  "with runtime.strategy.scope():",
                  f"    model = {build}",
                  f"    optimizer = {optimizer}"]
        if row["compression"] != "none":
            lines += ["    from tfpar.compression import make_aggregator, wrap_optimizer",
                      "    optimizer = wrap_optimizer(optimizer, make_aggregator(config))"]
        lines += ["    model.compile(optimizer=optimizer, loss=loss)"]
        if row["microbatches"] > 1:
            lines += ["    from tfpar import accumulation",
                      f"    accumulation.install(model, {row['microbatches']})"]
        lines += [f"model.fit(dataset)  # per-replica batches of {_per_replica(row, request)}"]
    return lines


def _per_replica(row, request):
    """What each replica's batch holds: `"16"`, or where dp does not divide the batch the
    real examples and the padding of weight 0 (`tfpar.replica_split`)."""
    from tfpar.replica_split import split_examples

    split = split_examples(request.global_batch_size, row["data"], row["microbatches"])
    if split.even:
        return str(split.padded)
    return (f"{split.padded} ({split.describe()} real, padded with examples of weight 0 and "
            f"the real ones weighted {split.weight:g}, as tfpar.replica_split does)")
