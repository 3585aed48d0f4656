"""Child process for tests/test_zero.py: `python tests/zero_child.py CASES_JSON OUT_PREFIX`.

Trains each case of `CASES_JSON` (a list of `{"name": str, **ParallelConfig settings}`) in
turn on one runtime (TensorFlow allows one strategy per process; every case must ask for
the same devices and run on the same backend: tf.distribute, or a DTensor mesh for
`zero_stage=3`), saves each case's final weights to `OUT_PREFIX.NAME[.worker<i>].npz`
and prints one JSON line: per case the losses, the step it resumed from, the optimizer
state per device, the median step time, the `comm` and `offload` blocks.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import graph_optimizer  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import ParallelConfig, backends, compat, devices, strategy  # noqa: E402
from tfpar.layout import values  # noqa: E402
from tfpar.train import train  # noqa: E402


def main():
    cases, prefix = json.loads(sys.argv[1]), sys.argv[2]
    worker = os.environ.get("TFPAR_WORKER_INDEX")
    out, runtime = {}, None
    for case in cases:
        name = case.pop("name")
        config = ParallelConfig(**case)
        if runtime is None and compat.backend_of(config) == "dtensor":
            runtime = backends.for_config(config).build_runtime(config)  # the mesh
        elif runtime is None:
            devices.split_cpu(config.cpu_devices)
            runtime = strategy.make_runtime(config)
        result, model = train(config, runtime=runtime)
        path = f"{prefix}.{name}" + (f".worker{worker}" if worker is not None else "") + ".npz"
        np.savez(path, *[np.asarray(values.to_host(v.value)) for v in model.weights])
        out[name] = {"final_loss": result["final_loss"],
                     "loss_history": result["loss_history"],
                     "replicas": result["replicas"], "workers": result["workers"],
                     "resumed_from_step": result.get("resumed_from_step", 0),
                     "optimizer_state_bytes_per_device":
                         result["memory"]["optimizer_state_bytes_per_device"],
                     "param_bytes_per_device": result["memory"]["param_bytes_per_device"],
                     "step_time_ms": result["step_time_ms"]["median"],
                     "comm": result.get("comm"), "offload": result.get("offload"),
                     "grappler": graph_optimizer.setting()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    graph_optimizer.apply()  # the test's choice (tests/graph_optimizer.py)
    main()
