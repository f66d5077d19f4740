#!/usr/bin/python3
"""Reference numbers: PyTorch's Gloo collectives (torch.distributed), float32
SUM, same sizes and columns as `tdist-bench collectives` (each call timed
alone: median and 99th percentile of the slowest rank's times). An op this
PyTorch's Gloo lacks is left out, with one line saying so. For comparison only;
tdist does not use Python. Runs under PyTorch 1.13 (Debian's python3-torch,
/usr/bin/python3) and 2.x (the venv of scripts/torch2.sh, .venv/bin/python)
alike, and records torch.__version__ in every JSON row.

    PYTHON bench/torch_collectives_reference.py [--world-size 2] [--op all_reduce,...]
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


def percentile(v, p):
    v = sorted(v)
    at = p / 100 * (len(v) - 1)
    lo = int(at)
    return v[lo] + (at - lo) * (v[lo + 1] - v[lo]) if lo + 1 < len(v) else v[-1]


def op_call(op, world):
    """The torch.distributed call for op on (input, output), or the reason it has none."""
    if op == "all_reduce":
        return lambda i, o: dist.all_reduce(i)
    if op == "broadcast":
        return lambda i, o: dist.broadcast(i, 0)
    name = {"reduce_scatter": ("reduce_scatter_tensor", "_reduce_scatter_base"),
            "all_gather": ("all_gather_into_tensor", "_all_gather_base")}[op]
    fn = getattr(dist, name[0], None) or getattr(dist, name[1], None)
    return (lambda i, o: fn(o, i)) if fn else None


def buffers(op, count, world):
    if op == "reduce_scatter":
        return torch.ones(count), torch.empty(count // world)
    if op == "all_gather":
        return torch.ones(count // world), torch.empty(count)
    return torch.ones(count), None


def timed(call, i, o, iters, barrier_each=False):
    """Each call timed alone (after an untimed barrier with barrier_each); the slowest rank's times."""
    t = torch.empty(iters, dtype=torch.float64)
    dist.barrier()
    for k in range(iters):
        if barrier_each:
            dist.barrier()
        t0 = time.perf_counter()
        call(i, o)
        t[k] = time.perf_counter() - t0
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rank_main(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows, skipped = [], []
    for op in args.op.split(","):
        call = op_call(op, world)
        size = max(parse_bytes(args.min_bytes), 4)
        while call and size <= parse_bytes(args.max_bytes):
            count = size // 4 if op in ("all_reduce", "broadcast") else size // 4 // world * world
            if count == 0:  # too small to share out
                size = int(size * args.step_factor)
                continue
            i, o = buffers(op, count, world)
            try:
                for _ in range(3):
                    call(i, o)
            except RuntimeError as e:  # this PyTorch's Gloo lacks the op
                skipped.append(f"{op}: {str(e).splitlines()[0]}")
                break
            est = timed(call, i, o, 3, args.barrier_each)
            iters = int(min(max(args.seconds / max(percentile(est, 50), 1e-7), 20), 20000))
            t = timed(call, i, o, iters, args.barrier_each)
            med, p99 = percentile(t, 50), percentile(t, 99)
            algbw = count * 4 / med / 1e9
            bus = 2 * (world - 1) / world if op == "all_reduce" else 1 if op == "broadcast" else (world - 1) / world
            rows.append(dict(op=op, backend="torch-gloo", world_size=world, dtype="float32", bytes=count * 4,
                             time_us=med * 1e6, p99_us=p99 * 1e6, algbw_GBps=algbw, busbw_GBps=algbw * bus,
                             torch_version=torch.__version__))
            size = int(size * args.step_factor)
        if not call:
            skipped.append(f"{op}: no such call in torch {torch.__version__}")
    if rank == 0:
        out.put((rows, skipped))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--op", default="all_reduce", help="comma-separated: all_reduce,reduce_scatter,all_gather,broadcast")
    ap.add_argument("--min-bytes", default="4")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--step-factor", type=float, default=4)
    ap.add_argument("--seconds", type=float, default=0.25)
    ap.add_argument("--json")
    ap.add_argument("--barrier-each", action="store_true", help="an untimed barrier before each timed call")
    args = ap.parse_args()
    rows, skipped = run_ranks(rank_main, args)
    for op in args.op.split(","):
        print(f"\n# {op}, torch {torch.__version__} gloo, world size {args.world_size}, float32")
        print(f"{'size(B)':>12} {'time(us)':>11} {'p99(us)':>11} {'algbw':>9} {'busbw':>9}")
        for r in rows:
            if r["op"] == op:
                print(f"{r['bytes']:>12} {r['time_us']:>11.2f} {r['p99_us']:>11.2f} {r['algbw_GBps']:>9.2f} "
                      f"{r['busbw_GBps']:>9.2f}")
    for s in skipped:
        print(f"# (left out: {s})")
    if args.json:  # one row per line, like tdist-bench's JSON
        with open(args.json, "w") as f:
            f.write("[\n" + ",\n".join("  " + json.dumps(r) for r in rows) + "\n]\n")


if __name__ == "__main__":
    main()
