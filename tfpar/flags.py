"""The absl flags of `python -m tfpar.train`, one per `ParallelConfig` field.

Help text comes from one table; defaults come from `ParallelConfig` itself, so the two can
never disagree. `--flagfile=configs/NAME.cfg` works as absl provides it.

Importing this module (or any tfpar module) defines no flag: only the entry points'
`run()` functions call `define_flags`, so a user script with its own `--steps` or `--seed`
can import tfpar. The flags are made key flags of the program being run, so `--help` (not
only `--helpfull`) lists them, for `python -m tfpar.train` and `tfpar-train` alike.
"""

import dataclasses
import sys

from absl import flags

from tfpar import config as config_lib
from tfpar.legacy import options as legacy_options
from tfpar.errors import ConfigError

_HELP = {
    "model": "Model from tfpar/models/ to train.",
    "model_width": "Override the model's width (units, channels or d_model); 0 = default.",
    "model_depth": "Override the model's depth (layers or blocks); 0 = default.",
    "dataset": "'auto' (the model's generated task) or 'module:function' returning a "
               "tf.data.Dataset of per-replica (x, y[, w]) batches for (input_context, config).",
    "num_classes": "Classes (or vocabulary) of a --dataset=module:function task.",
    "global_batch_size": "Examples per step over all replicas.",
    "steps": "Optimizer steps to train.",
    "steps_per_epoch": "Optimizer steps between epoch ends.",
    "optimizer": "Optimizer.",
    "learning_rate": "Learning rate for --base_batch_size examples.",
    "scale_lr": "Linear scaling rule: multiply the learning rate by effective batch / "
                "--base_batch_size.",
    "base_batch_size": "The batch size --learning_rate was tuned for.",
    "warmup_steps": "Linear learning-rate warm-up steps.",
    "grad_accum_steps": "Batches whose gradients are averaged into one update.",
    "mixed_precision": "Mixed precision policy (fp16 adds dynamic loss scaling).",
    "seed": "Seed for weights, data and dropout.",
    "on_nan": "At a NaN/Inf loss or gradient: stop (naming the step) or skip_step (leave "
              "weights and optimizer slots untouched for that step).",
    "fused_update": "Momentum SGD: update each weight and its momentum with TensorFlow's fused "
                    "ResourceApplyKerasMomentum kernel (Keras's formula in one pass) where it "
                    "applies: dense float32 gradients on tf.distribute; Keras's own update "
                    "elsewhere (sparse gradients, ZeRO, DTensor meshes). Off by default "
                    "(whole steps were not faster in every measured round).",
    "cpu_kernels": "TensorFlow's CPU kernels, set before it starts: auto = oneDNN unless "
                   "TF_ENABLE_ONEDNN_OPTS is already set; onednn; eigen (TensorFlow's own "
                   "default depends on the processor).",
    "strategy": "Distribution strategy; auto picks multi_worker under a TF_CONFIG cluster, "
                "mirrored over several local devices, else one_device.",
    "collective": "Collective implementation: auto = NCCL on GPUs, ring on CPUs.",
    "cpu_devices": "Split the CPU into N logical devices (simulated devices); 0 = off.",
    "allreduce": "How gradient sums cross hosts: hierarchical = reduce-scatter inside each "
                 "host, one ring across hosts per piece, all-gather inside (through one "
                 "worker a host when hosts differ in size or workers hold several GPUs); "
                 "flat = one ring over all workers; auto = hierarchical when TF_CONFIG "
                 "puts several workers on some host "
                 "of several.",
    "collective_timeout_s": "Seconds before a stalled collective becomes an error.",
    "heartbeat_timeout_s": "Seconds without a heartbeat before a peer counts as dead.",
    "startup_timeout_s": "Seconds for all workers to register before the job fails.",
    "data_parallel": "Data-parallel replicas; 0 = all devices.",
    "tensor_parallel": "Tensor-parallel degree.",
    "pipeline_stages": "Pipeline stages.",
    "microbatches": "Micro-batches per step in the pipeline.",
    "schedule": "Pipeline schedule.",
    "virtual_stages": "Virtual stages per device for the interleaved schedule.",
    "sequence_parallel": "With --tensor_parallel>1 on the transformer: split the norms' and "
                         "residual adds' activations along the sequence over the model axis "
                         "(Megatron-LM's sequence parallelism).",
    "compression": "Gradient aggregator.",
    "topk_ratio": "Fraction of gradient entries top-k sends.",
    "topk_warmup_steps": "Top-k's density warm-up (DGC): the fraction sent decays "
                         "exponentially from 25 % to --topk_ratio over this many steps; 0 = off.",
    "topk_dense_below": "Top-k sends tensors of at most this many entries whole (biases, "
                        "norms: few bytes); 0 = every tensor sparse.",
    "topk_union": "Top-k: every replica sends its own values at the union of all "
                  "replicas' indices (indices all-gathered first, then the values "
                  "all-reduced), so every sent entry is the exact sum.",
    "topk_momentum_carry": "Top-k with Adam in front (momentum synced): the share of the "
                           "synced momentum's continuation applied whether or not its entry "
                           "is sent (0 = only where sent, 1 = the momentum of the sum).",
    "threshold": "Magnitude above which threshold sparsification sends an entry.",
    "lowbit_bits": "Bits per gradient entry of --compression=lowbit (1-4; one fp32 scale per "
                   "256 entries of a tensor besides): 3 sends ~10x fewer bytes than fp32.",
    "powersgd_rank": "Rank of PowerSGD's low-rank approximation.",
    "powersgd_start_step": "Plain all-reduce before this step, PowerSGD after.",
    "powersgd_groups": "PowerSGD's matrices in this many groups, last layers first, each "
                       "with its own P and Q all-reduce: the last layers' sums run while "
                       "backward goes on (1: one P and one Q all-reduce a step).",
    "compress_adam_step": "With --optimizer=adam, top-k and PowerSGD run Adam in front of "
                          "the compression: --adam_warmup_steps exact Adam steps on all-reduced "
                          "gradients, then top-k compresses each replica's Adam step (the "
                          "second moment frozen), PowerSGD and auto the gradient over each "
                          "replica's own denominator (its second moment moved by its own exact "
                          "gradient). Off = compress gradients that Adam then normalises.",
    "adam_warmup_steps": "With --compress_adam_step: exact Adam steps (fp32 all-reduce, one "
                         "Adam on the sum) before compression starts (and top-k's second moment "
                         "freezes); 0 = no warm-up, each replica keeps its own Adam moments.",
    "auto_budget_ms": "--compression=auto: wall time per step the gradient exchange may take "
                      "on the link (measured at start); sets the high and low ranks.",
    "auto_link_mbps": "--compression=auto: act as on a link of this many Mbit/s instead of "
                      "measuring it; 0 = measure.",
    "auto_link_latency_ms": "--compression=auto: the latency that goes with --auto_link_mbps.",
    "error_feedback": "Keep what a lossy aggregator did not send and add it next step.",
    "bucket_mb": "Fuse small gradients into buckets of this many MB (0: no buckets: "
                 "--compression=none keeps Keras's own one all-reduce across workers too, "
                 "a codec sends each tensor alone).",
    "checkpoint_dir": "Directory for checkpoints; a run resumes from its latest one.",
    "checkpoint_every": "Optimizer steps between checkpoints.",
    "keep_checkpoints": "Checkpoints to keep.",
    "checkpoint_async": "Write checkpoints beside training: a save blocks the step only while "
                        "the state is copied to host memory (--nocheckpoint_async: the step "
                        "waits for the files).",
    "tensorboard_dir": "Directory for TensorBoard logs: Keras's epoch scalars and tfpar's "
                       "per-step tfpar/ scalars (tfpar.callbacks.TensorBoard).",
    "metrics_json": "Write the run's metrics JSON here.",
    "measure_comm": "After training, measure the communication share of a step "
                    "(compute-only vs full steps) into the metrics JSON.",
    "verbose": "0 = silent, 1 = progress bar, 2 = one line per epoch.",
    "validation_steps": "Batches of held-out data to evaluate at every epoch end (0 = off): "
                        "examples of the same generated task that training never reaches; "
                        "with --dataset=module:function, module.function_validation(input_"
                        "context, config) gives them. Reported as validation.loss/accuracy "
                        "in the metrics JSON and val_loss/val_accuracy to Keras callbacks.",
    "recompute": "Activation recomputation: none, blocks (each block keeps only its input "
                 "and is recomputed in the backward) or full (every layer; on pipelines each "
                 "stage's forward).",
    "zero_stage": "ZeRO sharding over data-parallel replicas: 0 = none, 1 = optimizer "
                  "state (each replica keeps 1/N of the SGD/Adam slots; mirrored, "
                  "multi_worker), 2 = also gradients reduce-scattered, 3 = also parameters "
                  "(on a DTensor mesh, also with --tensor_parallel). Every stage takes "
                  "--compression=fp16|bf16|int8 (a compressed reduce-scatter) and "
                  "--mixed_precision=fp16, also both; pipelines and the other codecs "
                  "are refused with it.",
    "zero_gather": "ZeRO-3's weight all-gather: fp32, or int8 (codes with an fp32 scale "
                   "per row, ZeRO++'s qwZ; the sharded master weights stay fp32).",
    "zero_prefetch": "ZeRO-3: issue each layer's weight gather one layer early, forward "
                     "and backward, at most two layers' weights whole at a time "
                     "(--nozero_prefetch: each gather just before its layer).",
    "zero_reshard_after_forward": "ZeRO-3: free each layer's whole weights after its "
                                  "forward and regather and recompute it in the backward "
                                  "(--nozero_reshard_after_forward: gather once a step, "
                                  "keep whole weights and activations; more memory, no "
                                  "recomputation).",
    "zero_keep_last_layers": "ZeRO-3: the last N layers the forward pass runs keep their "
                             "whole weights and activations for the backward, which starts "
                             "with them (gathered once, not recomputed); -1 = the last "
                             "layer at least as large as the median one and those after "
                             "it (a transformer's last block and output layers), 0 = none "
                             "(the default: -1 was no faster, measured idle side by side).",
    "offload": "CPU offload: none, or optimizer (momentum SGD's or Adam's slots in host "
               "memory, the update on the host: the gradient copied down and the step up "
               "each step; data parallelism and --zero_stage=1|2). optimizer+params is "
               "refused (not built).",
    **{name: help_text for name, (_, help_text) in legacy_options.FIELDS.items()},
}

_CHOICES = {
    "model": config_lib.MODELS, "optimizer": config_lib.OPTIMIZERS,
    "strategy": config_lib.STRATEGIES, "collective": config_lib.COLLECTIVES,
    "allreduce": config_lib.ALLREDUCE,
    "mixed_precision": config_lib.PRECISIONS, "compression": config_lib.COMPRESSIONS,
    "zero_gather": config_lib.ZERO_GATHERS, "offload": config_lib.OFFLOADS,
    "schedule": config_lib.SCHEDULES, "on_nan": config_lib.ON_NAN,
    "recompute": config_lib.RECOMPUTE, "cpu_kernels": config_lib.CPU_KERNELS,
}


def define_flags(flag_values=flags.FLAGS):
    """Defines one flag per `ParallelConfig` field (idempotent), key flags of the program
    being run (see `declare_key_flags`)."""
    names = [field.name for field in dataclasses.fields(config_lib.ParallelConfig)]
    for field in dataclasses.fields(config_lib.ParallelConfig):
        name, default = field.name, field.default
        if name in flag_values:
            continue
        help_text = _HELP[name]
        if name in _CHOICES:
            flags.DEFINE_enum(name, default, _CHOICES[name], help_text, flag_values=flag_values)
        elif isinstance(default, bool):
            flags.DEFINE_bool(name, default, help_text, flag_values=flag_values)
        elif isinstance(default, int):
            flags.DEFINE_integer(name, default, help_text, flag_values=flag_values)
        elif isinstance(default, float):
            flags.DEFINE_float(name, default, help_text, flag_values=flag_values)
        else:
            flags.DEFINE_string(name, default, help_text, flag_values=flag_values)
    declare_key_flags(names, flag_values)


def declare_key_flags(names, flag_values=flags.FLAGS):
    """Makes flags `names` key flags of the program being run, so `--help` lists them.

    absl's `--help` shows the key flags of the module named by `sys.argv[0]`: the file
    path under `python -m tfpar.train`, the script path under the `tfpar-train` console
    script. Flags defined in another module (or inside a function of an imported module)
    are not key flags of that name unless registered for it.
    """
    for name in names:
        if name in flag_values:  # absl's own (e.g. --log_dir) only on the global FLAGS
            flag_values.register_key_flag_for_module(sys.argv[0], flag_values[name])


def config_from_flags(flag_values=flags.FLAGS):
    """The validated `ParallelConfig` the parsed flags describe.

    Raises:
        ConfigError: a value is out of range, naming the flag.
    """
    values = {f.name: flag_values[f.name].value
              for f in dataclasses.fields(config_lib.ParallelConfig)}
    try:
        return config_lib.ParallelConfig(**values)
    except ConfigError as err:
        raise ConfigError(f"--{err.setting}", err.value, err.expected) from None
