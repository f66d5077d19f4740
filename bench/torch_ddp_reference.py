#!/usr/bin/python3
"""Reference numbers: PyTorch's DistributedDataParallel on Gloo, with the
model, data, optimizer, variants and columns of `tdist-bench ddp`. For
comparison only; tdist does not use Python. Runs under PyTorch 1.13 (Debian's
python3-torch, /usr/bin/python3) and 2.x (the venv of scripts/torch2.sh,
.venv/bin/python) alike, and records torch.__version__ in every JSON row.

    PYTHON bench/torch_ddp_reference.py [--world-size 2] [--steps 10] [--rounds 10]
        [--variants local,ddp_allreduce,...] [--zero-grad zero|none] [--json FILE]

A variant that this PyTorch cannot run (e.g. bf16 on Gloo in 1.13) is
reported as unavailable, with the reason.

zero_grad: `--zero-grad zero` (the default) zeroes the gradients in place,
optimizer.zero_grad(set_to_none=False), on every PyTorch version. That is what
`tdist-bench ddp` does when built against LibTorch 1.13 (bench/ddp_bench.cpp
calls Optimizer::zero_grad(), which in 1.13 takes no argument and zeroes), and
1.13's Python default. PyTorch 2.x's Python default (and LibTorch 2.x's C++
default) is set_to_none=True, so the argument is always passed explicitly:
both Python versions do the same thing. `--zero-grad none` drops the
gradients instead (set_to_none=True), on both versions.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from reference_common import run_ranks

VARIANTS = ["local", "ddp_allreduce", "ddp_fp16", "ddp_bf16", "ddp_noop", "status_quo",
            "ddp_allreduce_view", "ddp_fp16_view", "ddp_bf16_view", "local_all"]


DEVICE = torch.device("cpu")  # --device: every rank on cuda:0 with cuda


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10)).to(DEVICE)


def sync():  # a step on the GPU has only queued its kernels
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def noop_hook(_, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def make_variant(name, x, y, world, set_to_none):
    """Returns (runs_on_every_rank, step function)."""
    def sgd(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def zero_grad(opt):  # never the version's default: 1.13 zeroes, 2.x drops (see the top)
        opt.zero_grad(set_to_none=set_to_none)

    if name in ("local", "local_all"):
        model = make_model()
        opt = sgd(model.parameters())

        def step():
            zero_grad(opt)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return name == "local_all", step
    if name == "status_quo":
        model = make_model()
        opt = sgd(model.parameters())

        def step():
            zero_grad(opt)
            F.cross_entropy(model(x), y).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
        return True, step
    hook = name[4:]
    view = hook.endswith("_view")
    hook = hook[:-5] if view else hook
    ddp = DDP(make_model(), gradient_as_bucket_view=view,
              device_ids=[DEVICE.index] if DEVICE.type == "cuda" else None)
    hooks = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook, "noop": noop_hook}
    ddp.register_comm_hook(None, hooks[hook])
    opt = sgd(ddp.parameters())

    def step():
        zero_grad(opt)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return True, step


def rank_main(rank, world, port, args, out):
    global DEVICE
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    DEVICE = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    torch.manual_seed(1000 + rank)
    x = torch.randn(64, 784).to(DEVICE)
    y = torch.randint(0, 10, (64,)).to(DEVICE)
    built, unavailable = [], {}
    for name in args.variants:
        try:
            everyone, step = make_variant(name, x, y, world, args.zero_grad == "none")
            if everyone or rank == 0:
                for _ in range(3):
                    step()
            built.append((name, everyone, step))
        except Exception as e:  # noqa: BLE001 -- reported, not hidden
            unavailable[name] = str(e).splitlines()[0][:120]
        dist.barrier()
    times = {name: [] for name, _, _ in built}
    # As tdist-bench ddp: round r starts at variant r (mod their number), and
    # two untimed steps precede the timed ones.
    for r in range(args.rounds):
        for k in range(len(built)):
            name, everyone, step = built[(r + k) % len(built)]
            dist.barrier()
            if everyone or rank == 0:
                for _ in range(2):
                    step()
            dist.barrier()
            ms = 0.0
            if everyone or rank == 0:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                sync()
                ms = (time.perf_counter() - t0) * 1e3 / args.steps
            t = torch.tensor([ms], dtype=torch.float64, device=DEVICE if args.backend == "nccl" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item())
    if rank == 0:
        out.put((times, unavailable))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--zero-grad", choices=["zero", "none"], default="zero",
                    help="zero: optimizer.zero_grad(set_to_none=False), as tdist-bench ddp on LibTorch 1.13; "
                         "none: set_to_none=True")
    ap.add_argument("--backend", default="gloo", help="gloo, or nccl (with --device cuda)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: every rank on cuda:0")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v}")
    times, unavailable = run_ranks(rank_main, args)
    def median(v):
        v = sorted(v)
        n = len(v)
        return 0.0 if n == 0 else v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2

    def ratio(v):  # as tdist-bench ddp: the median of per-turn ratios to local
        if not times.get("local"):
            return 0.0
        return median([a / b for a, b in zip(times[v], times["local"])])

    print(f"\n# PyTorch {torch.__version__} DDP step time ({args.backend}, device {args.device}): MLP 784-1024-1024-10, batch 64 per rank, SGD, "
          f"1 thread per rank, world size {args.world_size}, zero_grad(set_to_none={args.zero_grad == 'none'})\n"
          f"# {args.rounds} rounds of {args.steps} steps (each round: the slowest rank's mean); ms/step: the median "
          f"round; x local: the median of per-turn ratios")
    print(f"{'variant':<20} {'ms/step':>10} {'best':>9} {'x local':>9}")
    rows = []
    for v in args.variants:
        if v in unavailable:
            print(f"{v:<20} {'-':>10} {'-':>9} {'-':>9}   unavailable: {unavailable[v]}")
            continue
        ms = median(times[v])
        print(f"{v:<20} {ms:>10.2f} {min(times[v]):>9.2f} {ratio(v):>9.2f}")
        rows.append(dict(variant=v, world_size=args.world_size, backend="torch-" + args.backend, device=args.device, ms_per_step=ms,
                         best_ms_per_step=min(times[v]), ratio_vs_local=ratio(v), torch_version=torch.__version__,
                         zero_grad_set_to_none=args.zero_grad == "none"))
    if args.json:
        with open(args.json, "w") as f:
            f.write("[\n" + ",\n".join("  " + json.dumps(r) for r in rows) + "\n]\n")


if __name__ == "__main__":
    main()
