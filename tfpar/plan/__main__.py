"""`python -m tfpar.plan`: how should this model run on this hardware?

Enumerates data × tensor × pipeline × micro-batches × interleaving × compression ×
activation recomputation (and with --zero ZeRO stages 1-3) layouts that use every device
and fit in memory, ranks them by predicted step time, and prints the choice, why, why
each neighbour lost, and how to run it (`--json` for tools). Nothing is built: built-in
models are profiled by formula, `--model=module:function` symbolically
(see `tfpar.plan.symbolic`).

    python -m tfpar.plan --model=transformer --model_width=8192 --model_depth=48 \\
        --devices=64 --devices_per_machine=8 --memory_gb=80 --tflops=300 \\
        --intra_gbps=2400 --inter_gbps=200 --global_batch_size=512
    python -m tfpar.plan --model=my_models:my_gpt --devices=8 --memory_gb=16
    python -m tfpar.plan --model=mlp --devices=4 --calibrate     # measure this machine
"""

import json
import sys

from absl import app, flags

from tfpar import flags as tfpar_flags

FLAGS = flags.FLAGS


def define_flags(flag_values=FLAGS):
    """The planner's flags (idempotent; only `run()` calls this, importing defines none)."""
    if "devices" in flag_values:
        return
    f = dict(flag_values=flag_values)
    before = set(flag_values)
    flags.DEFINE_string("model", "mlp", "mlp, convnet, transformer, or module:function "
                        "returning your Keras model (see tfpar.plan.symbolic).", **f)
    flags.DEFINE_integer("model_width", 0, "Width of the built-in model; 0 = default.", **f)
    flags.DEFINE_integer("model_depth", 0, "Depth of the built-in model; 0 = default.", **f)
    flags.DEFINE_integer("heads", 0, "Transformer: attention heads to plan for (0: what "
                         "tfpar.train builds, 4).", **f)
    flags.DEFINE_integer("seq_len", 0, "Transformer: sequence length (0: tfpar.train's "
                         "task, 16).", **f)
    flags.DEFINE_integer("vocab_size", 0, "Transformer: vocabulary (0: tfpar.train's "
                         "task, 17).", **f)
    flags.DEFINE_integer("global_batch_size", 64, "Examples per optimizer step.", **f)
    flags.DEFINE_enum("optimizer", "adam", ["sgd", "momentum", "adam"], "Optimizer (its "
                      "state per parameter).", **f)
    flags.DEFINE_enum("schedule", "auto", ["auto", "gpipe", "1f1b", "interleaved", "chimera"],
                      "Pipeline schedule (auto: rank 1f1b and chimera; interleaved also ranks "
                      "2 and 4 virtual stages).", **f)
    flags.DEFINE_enum("mixed_precision", "none", ["none", "bf16", "fp16"],
                      "Activations in 16 bits (weights and gradients stay fp32).", **f)
    flags.DEFINE_integer("data_parallel", 0, "Pin the data-parallel degree (0: free).", **f)
    flags.DEFINE_integer("tensor_parallel", 1, "Pin the tensor-parallel degree (1: free).",
                         **f)
    flags.DEFINE_integer("pipeline_stages", 1, "Pin the pipeline stages (1: free).", **f)
    flags.DEFINE_string("compression", "none", "Allow only this aggregator besides the "
                        "plain all-reduce (none: every aggregator).", **f)
    flags.DEFINE_enum("recompute", "auto", ["auto", "on", "off"], "Activation "
                      "recomputation of the blocks (--recompute=blocks in tfpar.train).", **f)
    flags.DEFINE_bool("zero", False, "Also rank ZeRO stages 1-3 (runnable where "
                      "tfpar.compat accepts --zero_stage; marked otherwise).", **f)
    flags.DEFINE_integer("devices", 0, "Devices to plan for (with --calibrate: "
                         "--cpu_devices).", lower_bound=0, **f)
    flags.DEFINE_integer("cpu_devices", 0, "--calibrate: logical CPUs to measure.",
                         lower_bound=0, **f)
    flags.DEFINE_float("memory_gb", 16.0, "Memory of one device, GB.", lower_bound=0, **f)
    flags.DEFINE_float("tflops", 10.0, "Sustained matmul TFLOP/s of one device.",
                       lower_bound=0, **f)
    flags.DEFINE_float("intra_gbps", 100.0, "Bandwidth of one device to the others of its "
                       "machine, Gbit/s.", lower_bound=0, **f)
    flags.DEFINE_float("inter_gbps", 10.0, "One device's share of its machine's network, "
                       "Gbit/s.", lower_bound=0, **f)
    flags.DEFINE_integer("devices_per_machine", 0, "Devices per machine (0: one machine).",
                         lower_bound=0, **f)
    flags.DEFINE_float("latency_us", 20.0, "Latency of one step of a ring collective, µs.",
                       lower_bound=0, **f)
    flags.DEFINE_float("memory_gbps", 0.0, "Device memory bandwidth, GB/s, for the cost of "
                       "encoding gradients (0: a CPU-like default).", lower_bound=0, **f)
    flags.DEFINE_float("dp_overlap", 0.0, "Share of the data-parallel gradient all-reduce "
                       "hidden behind backward: a run's comm.overlap_fraction (--measure_comm).",
                       lower_bound=0, upper_bound=1, **f)
    flags.DEFINE_bool("calibrate", False, "Measure this machine (on --cpu_devices logical "
                      "CPUs) instead of the hardware flags: all-reduce bandwidth and "
                      "latency, then per-unit costs fitted to short training runs of "
                      "--model (built-in models only; about 2 minutes on 2 cores).", **f)
    flags.DEFINE_bool("json", False, "Print JSON instead of a table.", **f)
    flags.DEFINE_integer("top", 10, "Rows of the table.", lower_bound=1, **f)
    tfpar_flags.declare_key_flags(sorted(set(flag_values) - before), flag_values)


def model_profile(element_bytes):
    """`(profile, trainer_builds_it)` for --model."""
    from tfpar.plan import profile, symbolic

    if FLAGS.model in profile.BUILTIN:
        prof = profile.builtin_profile(FLAGS.model, FLAGS.model_width, FLAGS.model_depth,
                                       FLAGS.heads, FLAGS.seq_len, FLAGS.vocab_size,
                                       element_bytes)
        return prof, not (FLAGS.heads or FLAGS.seq_len or FLAGS.vocab_size)
    return symbolic.trace_profile(FLAGS.model, element_bytes), False


def main(argv):
    del argv
    from tfpar.config import ParallelConfig
    from tfpar.errors import ConfigError, TfparError
    from tfpar.plan import planner

    try:
        if FLAGS.compression not in ("none", "fp16", "bf16", "int8", "topk", "threshold",
                                     "powersgd", "lowbit"):
            raise ConfigError("compression", FLAGS.compression,
                              "choose none, fp16, bf16, int8, topk, threshold, powersgd or "
                              "lowbit")
        element_bytes = 2 if FLAGS.mixed_precision != "none" else 4
        prof, builds_it = model_profile(element_bytes)
        request = planner.Request(
            model=FLAGS.model, model_width=FLAGS.model_width, model_depth=FLAGS.model_depth,
            trainer_builds_it=builds_it, global_batch_size=FLAGS.global_batch_size,
            optimizer=FLAGS.optimizer, schedule=FLAGS.schedule,
            mixed_precision=FLAGS.mixed_precision, data_parallel=FLAGS.data_parallel,
            tensor_parallel=FLAGS.tensor_parallel, pipeline_stages=FLAGS.pipeline_stages,
            compression=FLAGS.compression, recompute=FLAGS.recompute,
            zero=(0, 1, 2, 3) if FLAGS.zero else (0,), simulated_cpu=FLAGS.calibrate)
        calibration = None
        if FLAGS.calibrate:
            if FLAGS.model not in ("mlp", "convnet", "transformer"):
                raise ConfigError("calibrate", True, "calibration trains tfpar.train's "
                                  "built-in models; plan yours with the hardware flags")
            config = ParallelConfig(model=FLAGS.model, model_width=FLAGS.model_width,
                                    model_depth=FLAGS.model_depth,
                                    global_batch_size=FLAGS.global_batch_size,
                                    optimizer=FLAGS.optimizer,
                                    schedule="1f1b" if FLAGS.schedule == "auto"
                                    else FLAGS.schedule,
                                    cpu_devices=FLAGS.cpu_devices)
            hardware, calibration = planner.calibrate(
                config, FLAGS.cpu_devices or FLAGS.devices or 2)
        else:
            hardware = planner.hardware_from(
                FLAGS.devices, FLAGS.memory_gb, FLAGS.tflops, FLAGS.intra_gbps,
                FLAGS.inter_gbps, FLAGS.devices_per_machine, FLAGS.latency_us,
                FLAGS.memory_gbps, FLAGS.dp_overlap)
        result = planner.plan(prof, hardware, request)
        if calibration is not None:
            result["calibration"] = calibration
    except TfparError as err:
        print(f"tfpar.plan: error: {err}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.json:
        print(json.dumps(result, indent=1))
    else:
        print(planner.table(result, FLAGS.top))


def run():
    """`tfpar-plan` / `python -m tfpar.plan`: defines the flags, then runs `main`."""
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
