"""Child process for tests/test_doctor.py: `python tests/doctor_child.py`.

The doctor's replica check on a MirroredStrategy of 4 logical CPUs: a healthy model, then
the same model after a per-replica write outside the optimizer step (replica 2 drifts).
Prints one JSON line: `[healthy status, planted status, planted detail]`.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar import ParallelConfig, devices  # noqa: E402
devices.split_cpu(4)
from tfpar import data, doctor, strategy  # noqa: E402
from tfpar.backends.distribute import DistributeBackend  # noqa: E402

config = ParallelConfig(cpu_devices=4)
runtime = strategy.make_runtime(config)
model = DistributeBackend().build_model(config, runtime, data.make_task(config))
healthy = doctor.check_replicas_in_sync(runtime, model)
# A per-replica write outside the optimizer step: replica 2 drifts.
kernel = model.get_layer("dense_1").kernel.value
kernel.values[2].assign_add(1e-3 * kernel.values[2])
planted = doctor.check_replicas_in_sync(runtime, model)
print(json.dumps([healthy.status, planted.status, planted.detail]))
