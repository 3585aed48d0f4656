"""The planner's cost model: pure arithmetic over a model profile and a hardware description.

Step time = a fixed per-step overhead + the optimizer update of the device's shard +
pipeline compute (with its bubble and a fixed cost per forward/backward action) +
data-parallel gradient all-reduce (scaled by the aggregator's compression, plus its
per-parameter encode/decode cost) + tensor-parallel activation all-reduces + pipeline
point-to-point transfers. Memory per device = weights, gradients and optimizer state of the
device's shard + the activations its schedule keeps alive. Every formula is a function with
a test against a hand-computed case.

The time of a step is linear in the hardware's per-unit costs (seconds per FLOP, per
parameter, per action, per step), which is what lets `tfpar.plan.calibration` fit them to
measured steps by least squares.
"""

import dataclasses
import math

# Bytes per parameter for weights + gradients + optimizer state (fp32 training).
STATE_BYTES = {"sgd": 8, "momentum": 12, "adam": 16}
# Bytes on the wire per fp32 gradient byte sent; see tfpar.compression.
COMPRESSION_RATIO = {"none": 1.0, "fp16": 2.0, "bf16": 2.0, "int8": 3.9}
BUCKET_BYTES = 25 * 2 ** 20  # gradients fused per collective (tfpar's --bucket_mb)
# Encode + decode seconds per gradient parameter of each aggregator, when not calibrated.
DEFAULT_ENCODE_SECONDS = {"fp16": 2e-9, "bf16": 2e-9, "int8": 2e-9, "topk": 2e-9,
                          "threshold": 2e-9, "powersgd": 2e-9}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Devices and links. Rates in FLOP/s and bytes/s; memory in bytes; costs in seconds.

    Per-device rates and costs are those seen while every device works at once (devices
    that share processor cores, like logical CPUs, are each slower then than alone).
    """

    devices: int
    memory_bytes: float
    flops: float                 # sustained training FLOP/s of one device, all busy
    intra_bandwidth: float       # between devices of one machine
    inter_bandwidth: float       # between machines
    devices_per_machine: int = 0  # 0: all devices on one machine
    # Aggregator name -> encode/decode seconds per gradient parameter of a device's shard.
    encode_seconds_per_param: dict = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_ENCODE_SECONDS))
    latency: float = 20e-6        # one step of a ring collective (a message round)
    action_overhead: float = 1e-4  # fixed cost of one pipeline forward or backward action
    step_overhead: float = 0.0    # fixed cost of a training step (loop, callbacks, launches)
    update_seconds_per_param: float = 0.0  # optimizer update of one parameter of the shard
    shared_cores: bool = False    # devices are slices of the same cores (logical CPUs)

    @property
    def machines(self):
        per = self.devices_per_machine or self.devices
        return math.ceil(self.devices / per)


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the cost model needs to know of a model.

    Args:
        params: trainable parameters.
        flops_per_example: forward FLOPs for one example.
        activation_bytes_per_example: bytes of layer outputs one example keeps for backward.
        boundary_bytes_per_example: bytes of one block's output (what a pipeline stage
            sends to the next, and what a tensor-parallel block all-reduces).
        blocks: how many stages the model can be cut into at most.
        tp_syncs_per_block: activation all-reduces per block (forward and backward) under
            tensor parallelism; 0 where the model has no tensor-parallel preset.
        max_tensor_parallel: the largest degree the presets can split it by.
        matrix_shapes: the 2-D shapes of its weight matrices (for PowerSGD's ratio).
    """

    name: str
    params: int
    flops_per_example: float
    activation_bytes_per_example: float
    boundary_bytes_per_example: float
    blocks: int
    tp_syncs_per_block: int = 0
    max_tensor_parallel: int = 1
    matrix_shapes: tuple = ()


@dataclasses.dataclass(frozen=True)
class Candidate:
    data: int
    tensor: int
    pipeline: int
    microbatches: int
    compression: str


def ring_allreduce_seconds(nbytes, n, bandwidth, latency=0.0):
    """Ring all-reduce of `nbytes` over `n` peers: 2(n-1) steps of latency α each, and
    2(n-1)/n · S / B of transfer."""
    return 0.0 if n <= 1 else 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth


def bubble_fraction(stages, microbatches, virtual=1):
    """Idle share of a pipeline step: (K-1) / (V·M + K-1)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def compression_ratio(name, profile, topk_ratio=0.01, rank=4):
    """fp32 bytes / bytes on the wire for aggregator `name` on `profile`'s gradients."""
    if name in COMPRESSION_RATIO:
        return COMPRESSION_RATIO[name]
    if name == "topk":
        return 1 / (2 * topk_ratio)  # a value and an int32 index per kept entry
    if name == "powersgd":
        matrix = sum(n * m for n, m in profile.matrix_shapes)
        sent = sum(rank * (n + m) for n, m in profile.matrix_shapes)
        rest = profile.params - matrix  # vectors go uncompressed
        return profile.params / max(1, sent + rest)
    raise ValueError(f"unknown compression {name!r}")


def memory_bytes(profile, c, global_batch, optimizer="adam", schedule="1f1b"):
    """Bytes one device needs: its shard's training state + live activations."""
    shard = profile.params / (c.tensor * c.pipeline)
    state = STATE_BYTES[optimizer] * shard
    micro = global_batch / c.data / c.microbatches
    # Micro-batches whose activations wait for their backward: without a pipeline (plain
    # or accumulated steps) one; GPipe all M; 1F1B at most K.
    if c.pipeline == 1:
        stash = 1
    elif schedule == "gpipe":
        stash = c.microbatches
    else:
        stash = min(c.pipeline, c.microbatches)
    activations = profile.activation_bytes_per_example / c.pipeline / c.tensor * micro * stash
    return state + activations


def step_seconds(profile, hw, c, global_batch):
    """Predicted seconds per optimizer step, and its parts."""
    per_device_examples = global_batch / c.data
    shard = profile.params / (c.tensor * c.pipeline)
    work = 3 * profile.flops_per_example * per_device_examples / (c.tensor * c.pipeline) / hw.flops
    # A pipeline runs a forward and a backward action per micro-batch, each with a fixed
    # cost whatever its size; a step without a pipeline is one `fit` step.
    actions = 2 * hw.action_overhead if c.pipeline > 1 else 0.0
    slot = work / c.microbatches + actions
    compute = c.microbatches * slot
    # A pipeline step is M + K - 1 slots on the critical path, K - 1 of them idle. Devices
    # that share cores lend them to the busy ones while idle: the bubble then costs only
    # its actions' fixed costs, not compute.
    bubble = (c.pipeline - 1) * (actions if hw.shared_cores else slot)
    overhead = hw.step_overhead + hw.update_seconds_per_param * shard
    # Data-parallel groups span machines once the model-parallel group fills a machine.
    per_machine = hw.devices_per_machine or hw.devices
    dp_bandwidth = hw.intra_bandwidth if c.data * c.tensor * c.pipeline <= per_machine \
        else hw.inter_bandwidth
    grad_bytes = 4 * shard
    ratio = compression_ratio(c.compression, profile)
    buckets = max(1, math.ceil(grad_bytes / ratio / BUCKET_BYTES))
    dp = ring_allreduce_seconds(grad_bytes / ratio, c.data, dp_bandwidth,
                                hw.latency * buckets)
    if c.compression != "none" and c.data > 1:
        dp += hw.encode_seconds_per_param[c.compression] * shard
    tp_bytes = profile.boundary_bytes_per_example * per_device_examples
    tp = profile.blocks * profile.tp_syncs_per_block * ring_allreduce_seconds(
        tp_bytes, c.tensor, hw.intra_bandwidth, hw.latency) / c.pipeline
    # Each micro-batch crosses K-1 boundaries forward and back; the transfers on the
    # critical path are those of one micro-batch through the pipe.
    p2p = 0.0 if c.pipeline == 1 else 2 * (c.pipeline - 1) * (hw.latency + (
        profile.boundary_bytes_per_example * per_device_examples / c.microbatches / c.tensor
    ) / hw.intra_bandwidth)
    total = overhead + compute + bubble + dp + tp + p2p
    return total, {"overhead": overhead, "compute": compute, "bubble": bubble,
                   "data_parallel": dp, "tensor_parallel": tp, "pipeline_p2p": p2p}


def candidates(profile, hw, global_batch, compressions=("none", "fp16", "int8", "topk",
                                                         "powersgd")):
    """Every (data, tensor, pipeline, micro-batches, compression) that uses all devices,
    splits the batch evenly, and tfpar can run."""
    out = []
    for tensor in _divisors(hw.devices):
        if tensor > profile.max_tensor_parallel:
            continue
        for pipeline in _divisors(hw.devices // tensor):
            if pipeline > profile.blocks:
                continue
            data = hw.devices // (tensor * pipeline)
            if global_batch % data:
                continue
            per_replica = global_batch // data
            if tensor > 1 and pipeline > 1:
                continue  # tfpar runs tensor parallelism without pipelines for now
            for m in ([1] if pipeline == 1 else [m for m in (2, 4, 8, 16, 32)
                                                  if per_replica % m == 0 and m >= pipeline]):
                # Aggregators reduce over data-parallel replicas (each pipeline stage its
                # own gradients); they do not plug into a DTensor mesh yet.
                plain = data == 1 or tensor > 1
                for comp in (("none",) if plain else compressions):
                    out.append(Candidate(data, tensor, pipeline, m, comp))
    return out


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]
