#!/usr/bin/python3
"""Reference numbers: PyTorch's Gloo all_reduce (torch.distributed), float32
SUM, same sizes and columns as `tdist-bench collectives`. For comparison only;
tdist does not use Python. Runs under PyTorch 1.13 (Debian's python3-torch,
/usr/bin/python3) and 2.x (the venv of scripts/torch2.sh, .venv/bin/python)
alike, and records torch.__version__ in every JSON row.

    PYTHON bench/torch_collectives_reference.py [--world-size 2]
        [--min-bytes 4] [--max-bytes 64M] [--step-factor 4] [--seconds 0.25] [--json FILE]
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from reference_common import run_ranks


def parse_bytes(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def rank_main(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    size = max(parse_bytes(args.min_bytes), 4)
    while size <= parse_bytes(args.max_bytes):
        t = torch.ones(size // 4)
        for _ in range(3):
            dist.all_reduce(t)
        t0 = time.perf_counter()
        dist.all_reduce(t)
        est = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(est, op=dist.ReduceOp.MAX)
        iters = int(min(max(args.seconds / max(est.item(), 1e-7), 5), 20000))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        took = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        us = took.item() * 1e6
        algbw = size / (us * 1e-6) / 1e9
        rows.append(dict(op="all_reduce", backend="torch-gloo", world_size=world, dtype="float32", bytes=size,
                         time_us=us, algbw_GBps=algbw, busbw_GBps=algbw * 2 * (world - 1) / world, wrong=0,
                         torch_version=torch.__version__))
        size = int(size * args.step_factor)
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--min-bytes", default="4")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--step-factor", type=float, default=4)
    ap.add_argument("--seconds", type=float, default=0.25)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = run_ranks(rank_main, args)
    print(f"\n# all_reduce, torch {torch.__version__} gloo, world size {args.world_size}, float32")
    print(f"{'size(B)':>12} {'time(us)':>11} {'algbw':>9} {'busbw':>9}")
    for r in rows:
        print(f"{r['bytes']:>12} {r['time_us']:>11.2f} {r['algbw_GBps']:>9.2f} {r['busbw_GBps']:>9.2f}")
    if args.json:  # one row per line, like tdist-bench's JSON
        with open(args.json, "w") as f:
            f.write("[\n" + ",\n".join("  " + json.dumps(r) for r in rows) + "\n]\n")


if __name__ == "__main__":
    main()
