#!/usr/bin/python3
"""PyTorch's own FSDP on CPU (Gloo), trained exactly as bench/fsdp_compare.cpp
trains tdist's FSDP, so that bench/compare_fsdp.sh can compare final weights,
step time and peak memory. For comparison only; tdist does not use Python.

    PYTHON bench/torch_fsdp_reference.py --out DIR [--api fsdp2|fsdp1] [--world-size 2]
        [--width 64] [--hidden 128] [--blocks 4] [--batch 16] [--steps 30] [--warmup 3]
        [--dtype float32|float64]
    PYTHON bench/torch_fsdp_reference.py --compare DIR_A DIR_B [--json FILE] [--tolerance 1e-5]

The model, the initial weights and the data are formulas, no random numbers:
Net = Linear(32 -> W) `in`; B residual blocks h = h + fc2(relu(fc1(h))) with
fc1: W -> H, fc2: H -> W; Linear(W -> 10) `head`. Parameter k (registration
order) element i starts at 0.05 * sin(0.7 i + 1.3 k); step s, global row j,
column c: x = sin(0.01 (1000 s + 37 j + c)), label (7 s + j) % 10; rank r of
N takes rows [r G / N, (r + 1) G / N). Each step: zero_grad(set_to_none),
forward, cross-entropy, backward, clip_grad_norm_(1.0), Adam(lr 1e-3).
FULL_SHARD, each block its own unit, `in` and `head` in the root unit.

A run writes DIR/weights.bin (the final full parameters, float32, in
registration order) and DIR/result.json (names, shapes, timings, VmHWM).
--dtype float64 trains in double precision (weights and data; written as
float32): how far each float32 run is from the exact result.
--compare reads two such directories and prints, per parameter, the maximum
relative difference max|a - b| / max|b|; exits 1 when one exceeds the tolerance.
If a rank fails (e.g. an FSDP feature missing on CPU), its traceback is printed
and the run exits non-zero.
"""
import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference_common import run_ranks, vm_kib

IN_FEATURES, CLASSES = 32, 10


class Block(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, h):
        return h + self.fc2(F.relu(self.fc1(h)))


class Net(nn.Module):
    def __init__(self, width, hidden, blocks):
        super().__init__()
        self.add_module("in", nn.Linear(IN_FEATURES, width))  # `in` is a keyword: no attribute syntax
        self.blocks = [Block(width, hidden) for _ in range(blocks)]
        for b, block in enumerate(self.blocks):
            self.add_module(f"block{b}", block)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        h = getattr(self, "in")(x)
        for b in range(len(self.blocks)):
            h = getattr(self, f"block{b}")(h)  # the registered (possibly wrapped) module
        return self.head(h)


def init_weights(net):
    with torch.no_grad():
        for k, p in enumerate(net.parameters()):
            i = torch.arange(p.numel(), dtype=torch.float64)
            p.copy_((0.05 * torch.sin(0.7 * i + 1.3 * k)).to(torch.float32).view_as(p))


def batch(step, rank, world, rows):
    lo, hi = rank * rows // world, (rank + 1) * rows // world
    j = torch.arange(lo, hi, dtype=torch.float64).unsqueeze(1)
    c = torch.arange(IN_FEATURES, dtype=torch.float64).unsqueeze(0)
    x = torch.sin(0.01 * (step * 1000 + j * 37 + c)).to(torch.float32)
    y = (step * 7 + torch.arange(lo, hi, dtype=torch.int64)) % CLASSES
    return x, y



def wrap(net, api):
    """FULL_SHARD, each block a unit of its own, the rest in the root's."""
    if api == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in net.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        return fully_shard(net, mesh=mesh, reshard_after_forward=True)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    # device_id=cpu: without it, 2.x's FSDP1 looks for an accelerator and
    # refuses ("FSDP needs a non-CPU accelerator device, ...").
    kw = dict(sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True, device_id=torch.device("cpu"))
    for b in range(len(net.blocks)):
        setattr(net, f"block{b}", FSDP(getattr(net, f"block{b}"), **kw))
    return FSDP(net, **kw)


def full_weights(model, api):
    """Every parameter whole, in registration order, on every rank (collective)."""
    if api == "fsdp2":
        return [(n, p.full_tensor().detach().clone()) for n, p in model.named_parameters()]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    with FSDP.summon_full_params(model, writeback=False):
        return [(n.replace("_fsdp_wrapped_module.", ""), p.detach().clone()) for n, p in model.named_parameters()]


def rank_main(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for module in ("torch.distributed.device_mesh", "torch.distributed.fsdp"):
        importlib.import_module(module)  # before the baseline: imports are not what FSDP costs
    baseline = vm_kib("VmHWM")
    dtype = getattr(torch, args.dtype)
    net = Net(args.width, args.hidden, args.blocks)
    init_weights(net)
    net.to(dtype)
    model = wrap(net, args.api)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times, losses = [], []
    for s in range(args.steps):
        x, y = batch(s, rank, world, args.batch)
        x = x.to(dtype)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if args.api == "fsdp2":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            model.clip_grad_norm_(1.0)
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())  # after the clock: reading it is no part of a step
    stats = torch.tensor([statistics.median(times[args.warmup:] or times), vm_kib("VmHWM"), baseline],
                         dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank, the largest peak
    per_step = torch.tensor(times, dtype=torch.float64)
    step_loss = torch.tensor(losses, dtype=torch.float64)  # each step's loss, the mean over ranks
    if times:
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
        dist.all_reduce(step_loss)
        step_loss /= world
    weights = full_weights(model, args.api)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        params, offset = [], 0
        with open(os.path.join(args.out, "weights.bin"), "wb") as f:
            for name, w in weights:
                f.write(w.to(torch.float32).contiguous().numpy().tobytes())
                params.append(dict(name=name, shape=list(w.shape), offset=offset, numel=w.numel()))
                offset += w.numel()
        precision = "" if args.dtype == "float32" else f" {args.dtype}"
        result = dict(impl=f"PyTorch {torch.__version__} {args.api.upper()}{precision} (gloo)", world_size=world,
                      width=args.width, hidden=args.hidden, blocks=args.blocks, batch=args.batch, steps=args.steps,
                      warmup=args.warmup, ms_per_step=stats[0].item(), step_ms=per_step.tolist(),
                      peak_rss_mib=stats[1].item() / 1024, baseline_rss_mib=stats[2].item() / 1024,
                      step_loss=step_loss.tolist(), final_loss=step_loss[-1].item() if losses else 0.0,
                      params=params)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def load(directory):
    with open(os.path.join(directory, "result.json")) as f:
        result = json.load(f)
    flat = np.fromfile(os.path.join(directory, "weights.bin"), dtype=np.float32)
    return result, {p["name"]: flat[p["offset"]:p["offset"] + p["numel"]].reshape(p["shape"])
                    for p in result["params"]}


def compare(dir_a, dir_b, tolerance, json_path):
    """Per parameter max|a - b| / max|b| (held to `tolerance`) and, for
    information, |a - b| / |b| (2-norms); returns the exit status."""
    (ra, wa), (rb, wb) = load(dir_a), load(dir_b)
    if list(wa) != list(wb):
        print(f"parameter names differ:\n  {ra['impl']}: {list(wa)}\n  {rb['impl']}: {list(wb)}")
        return 1
    rows, worst = [], 0.0
    print(f"{'parameter':<22} {'shape':>12} {'max rel diff':>13} {'norm rel diff':>13}")
    for name in wa:
        a, b = wa[name].astype(np.float64), wb[name].astype(np.float64)
        if a.shape != b.shape:
            print(f"{name:<22} shapes differ: {a.shape} vs {b.shape}")
            return 1
        rel = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)) if b.size else 0.0
        norm_rel = float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30)) if b.size else 0.0
        worst = max(worst, rel) if math.isfinite(rel) else math.inf
        print(f"{name:<22} {'x'.join(map(str, a.shape)):>12} {rel:>13.3e} {norm_rel:>13.3e}"
              f"{'  > tolerance' if rel > tolerance else ''}")
        rows.append(dict(name=name, shape=list(a.shape), max_rel_diff=rel, norm_rel_diff=norm_rel))
    print(f"{'worst':<22} {'':>12} {worst:>13.3e}  ({'within' if worst <= tolerance else 'BEYOND'} {tolerance:g})")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(a=ra["impl"], b=rb["impl"], tolerance=tolerance, worst=worst,
                           worst_norm_rel=max((r["norm_rel_diff"] for r in rows), default=0.0), params=rows),
                      f, indent=1)
    return 0 if worst <= tolerance else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", choices=["fsdp2", "fsdp1"], default="fsdp2")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global rows per step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--out", help="directory for weights.bin and result.json")
    ap.add_argument("--compare", nargs=2, metavar="DIR", help="compare two runs' weights instead of training")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--json", help="with --compare: also write the comparison here")
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare, args.tolerance, args.json))
    if not args.out:
        ap.error("--out is required")
    result = run_ranks(rank_main, args)
    print(f"# {result['impl']}, world {args.world_size}, W={args.width} H={args.hidden} B={args.blocks} "
          f"batch {args.batch}, {args.steps} steps: {result['ms_per_step']:.2f} ms/step, peak RSS "
          f"{result['peak_rss_mib']:.1f} MiB, final loss {result['final_loss']:.6f}")


if __name__ == "__main__":
    main()
