"""Where the PyTorch peer's DDP step goes, two gloo ranks across the shaped link.

The peer of `tools/bench_compression_vs_torch.py` (`torch_ddp_compression.py` from
`--peer_dir`: its model, data and optimizer, one thread per rank, one 64 MB bucket) runs in the
two namespaces of `tools/shaped_link.py` (tbf at `--rate`; the peer's own script uses a
smaller burst and a longer queue, which changes no compute piece). After `--warmup` untimed
steps (more than the hook's 10 uncompressed ones) it alternates two kinds of step over
`--calls` calls each and prints medians (ms):

    data            one batch from the peer's teacher
    forward         forward + cross-entropy
    backward        `loss.backward()` with DDP's hook (DDP waits for the hook's future)
    hook            the comm hook alone: its call (bucket ready) to its future's completion
    optimizer       `opt.step()` (momentum SGD, torch's foreach implementation)
    step            data + forward + zero_grad + backward + optimizer (the peer's step)
    backward_local  `loss.backward()` under `ddp.no_sync()`: backward without the hook

Each piece is printed as wall-clock ms and rank 0's CPU ms (user + system, all threads of
the process: gloo's included), as `tools/profile_powersgd.py` prints tfpar's; the hook runs
on gloo's threads while backward waits, so its CPU is printed as `backward`'s minus
`backward_local`'s, its wall as timed from its call to its future's completion.

    python tools/profile_torch_peer.py --peer_dir=../shared/peers \
        --torch_py=$HOME/.venvs/torch-peer/bin/python --global_batch_size=256

Needs root and iproute2; run it under the CPU lock.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 29571


def worker(settings_json, out_path):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = json.loads(settings_json)
    sys.path.insert(0, s["peer_dir"])
    import torch_ddp_compression as peer

    torch.set_num_threads(1)  # the peer's default (--threads 1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_b = s["batch"] // world
    torch.manual_seed(0)
    ddp = DDP(peer.build_student(), bucket_cap_mb=64)
    hook_ms = []

    def timed(hook):
        def run(state, bucket):
            began = time.perf_counter()

            def done(fut):
                hook_ms.append(1000 * (time.perf_counter() - began))
                return fut.value()
            return hook(state, bucket).then(done)
        return run

    if s["mode"] == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=dist.group.WORLD, matrix_approximation_rank=s["rank"],
            start_powerSGD_iter=10, use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, timed(powerSGD_hook.powerSGD_hook))
    elif s["mode"] == "fp16":
        ddp.register_comm_hook(dist.group.WORLD, timed(default_hooks.fp16_compress_hook))
    else:
        ddp.register_comm_hook(dist.group.WORLD, timed(default_hooks.allreduce_hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    teacher = peer.Teacher()
    ms = {k: [] for k in ("data", "forward", "backward", "hook", "optimizer", "step",
                          "backward_local")}
    cpu = {k: [] for k in ms if k != "hook"}
    dist.barrier()
    for step in range(s["warmup"] + 2 * s["calls"]):
        timed_step = step >= s["warmup"]
        local = timed_step and (step - s["warmup"]) % 2 == 1
        t0, c0 = time.perf_counter(), time.process_time()
        x, y = peer.batch(teacher, 0, step, rank, local_b)
        t1, c1 = time.perf_counter(), time.process_time()
        if local:
            with ddp.no_sync():
                loss = F.cross_entropy(ddp(x), y)
                t2, c2 = time.perf_counter(), time.process_time()
                opt.zero_grad(set_to_none=True)
                loss.backward()
            ms["backward_local"].append(1000 * (time.perf_counter() - t2))
            cpu["backward_local"].append(1000 * (time.process_time() - c2))
            opt.zero_grad(set_to_none=True)
            continue
        n_hooks = len(hook_ms)
        loss = F.cross_entropy(ddp(x), y)
        t2, c2 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3, c3 = time.perf_counter(), time.process_time()
        opt.step()
        t4, c4 = time.perf_counter(), time.process_time()
        if timed_step:
            for k, a, b, ca, cb in (("data", t0, t1, c0, c1), ("forward", t1, t2, c1, c2),
                                    ("backward", t2, t3, c2, c3),
                                    ("optimizer", t3, t4, c3, c4), ("step", t0, t4, c0, c4)):
                ms[k].append(1000 * (b - a))
                cpu[k].append(1000 * (cb - ca))
            ms["hook"] += hook_ms[n_hooks:]
    out = {k: statistics.median(v) for k, v in ms.items() if v}
    out["cpu"] = {k: statistics.median(v) for k, v in cpu.items() if v}
    out["cpu"]["hook"] = out["cpu"]["backward"] - out["cpu"]["backward_local"]
    out["loss_last"] = float(loss)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer_dir", help="directory holding torch_ddp_compression.py (required)")
    p.add_argument("--torch_py", help="the peer's Python, with torch (required)")
    p.add_argument("--global_batch_size", type=int, default=256)
    p.add_argument("--mode", default="powersgd", choices=["powersgd", "fp16", "fp32"])
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--warmup", type=int, default=12)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "profile_torch_peer.json"))
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    if not args.peer_dir or not args.torch_py:
        p.error("--peer_dir and --torch_py are required")
    if args.calls < 1:
        p.error(f"--calls={args.calls} is invalid: at least 1 timed call per piece")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from shaped_link import ShapedLink

    settings = {"peer_dir": os.path.abspath(args.peer_dir), "batch": args.global_batch_size,
                "mode": args.mode, "rank": args.rank, "warmup": args.warmup,
                "calls": args.calls}
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if os.path.exists(out):
        os.remove(out)
    with ShapedLink(rate=args.rate) as link:
        procs = []
        for i in range(2):
            env = dict(os.environ, RANK=str(i), WORLD_SIZE="2", MASTER_ADDR=link.address(0),
                       MASTER_PORT=str(PORT), GLOO_SOCKET_IFNAME=link.devices[i])
            procs.append(link.popen(i, [args.torch_py, os.path.abspath(__file__), "--worker",
                                        json.dumps(settings), out], env=env))
        codes = [proc.wait(timeout=args.timeout) for proc in procs]
    if any(codes):
        print(f"profile_torch_peer: ranks exited {codes}", file=sys.stderr)
        return 1
    with open(out) as f:
        result = json.load(f)
    print(f"PyTorch DDP {args.mode}, batch {args.global_batch_size}, {args.rate}, median of "
          f"{args.calls} calls (ms)")
    print(f"  {'piece':15} {'wall':>8} {'CPU':>8}")
    for k, v in result.items():
        if k != "cpu":
            cpu = f"{result['cpu'][k]:8.2f}" if k in result["cpu"] else ""
            print(f"  {k:15} {v:8.2f} {cpu}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
