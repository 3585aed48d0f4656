"""`python -m tfpar.plan`: how should this model run on this hardware?

Enumerates (data, tensor, pipeline, micro-batches, compression) layouts that use every
device and fit in memory, ranks them by predicted step time, and prints a table with the
reasons and the exact `python -m tfpar.train` command of the winner (`--json` for tools).

    python -m tfpar.plan --model=transformer --devices=8 --memory_gb=16 --tflops=100
    python -m tfpar.plan --model=mlp --devices=4 --calibrate     # measure this machine
"""

import json
import sys

from absl import app, flags

from tfpar import flags as tfpar_flags
from tfpar.errors import TfparError
from tfpar.plan import planner

FLAGS = flags.FLAGS


def define_flags(flag_values=FLAGS):
    """The trainer's flags and the planner's own (only `run()` calls this)."""
    tfpar_flags.define_flags(flag_values)
    if "devices" not in flag_values:
        define = dict(flag_values=flag_values)
        flags.DEFINE_integer("devices", 0, "Devices to plan for (0: the local devices, or "
                             "--cpu_devices with --calibrate).", lower_bound=0, **define)
        flags.DEFINE_float("memory_gb", 16.0, "Memory of one device, GB.", lower_bound=0,
                           **define)
        flags.DEFINE_float("tflops", 10.0, "Sustained matmul TFLOP/s of one device.",
                           lower_bound=0, **define)
        flags.DEFINE_float("intra_gbps", 100.0, "Bandwidth between devices of a machine, Gbit/s.",
                           lower_bound=0, **define)
        flags.DEFINE_float("inter_gbps", 10.0, "Bandwidth between machines, Gbit/s.",
                           lower_bound=0, **define)
        flags.DEFINE_integer("devices_per_machine", 0, "Devices per machine (0: one machine).",
                             lower_bound=0, **define)
        flags.DEFINE_bool("calibrate", False, "Measure this machine (on --cpu_devices logical "
                          "CPUs) instead of the hardware flags: all-reduce bandwidth and latency, "
                          "then compute rate, step, update, pipeline-action and encode costs "
                          "fitted to short training runs of --model at half and 4x "
                          "--global_batch_size "
                          "(about 2 minutes on 2 cores).", **define)
        flags.DEFINE_bool("json", False, "Print JSON instead of a table.", **define)
        flags.DEFINE_integer("top", 10, "Rows of the table.", lower_bound=1, **define)
    tfpar_flags.declare_key_flags(["devices", "memory_gb", "tflops", "intra_gbps", "inter_gbps",
                                   "devices_per_machine", "calibrate", "json", "top"],
                                  flag_values)


def main(argv):
    del argv
    try:
        config = tfpar_flags.config_from_flags()
        calibration = None
        if FLAGS.calibrate:
            hardware, calibration = planner.calibrate(config, config.cpu_devices
                                                      or FLAGS.devices or 2)
        else:
            hardware = planner.hardware_from(
                FLAGS.devices, FLAGS.memory_gb, FLAGS.tflops, FLAGS.intra_gbps,
                FLAGS.inter_gbps, FLAGS.devices_per_machine)
        result = planner.plan(config, hardware, simulated_cpu=FLAGS.calibrate)
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
    """`tfpar-plan` / `python -m tfpar.plan`."""
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
