#!/usr/bin/python3
"""Hugging Face's GPT2LMHeadModel trained with PyTorch's FSDP2 (fully_shard
per block, then the root) or DDP on CPU (Gloo), exactly as examples/gpt.cpp
trains tdist's GPT-2, so that bench/compare_gpt.sh can hold the two side by
side: final weights, tokens/s, peak RSS per rank. For comparison only; tdist
does not use Python.

    PYTHON bench/torch_gpt_reference.py --init DIR --data FILE --out DIR
        [--mode fsdp2|ddp] [--precision fp32|bf16] [--world-size 2] [--steps 20]
        [--batch-size 8] [--block-size 128] [--seed 1337] [--lr 1e-3] [--min-lr 1e-4]
        [--warmup 20] [--weight-decay 0.1] [--grad-clip 1.0]

What examples/gpt.cpp does, step for step: the model from_pretrained(--init)
(its dropout is the config's: the benchmark's configs have none); batches
of --batch-size windows of --block-size + 1 bytes per rank, at offsets drawn
by SplitMix64 from seed * 0x100000001B3 + step (world * batch draws per
step, rank r takes draws [r B, (r+1) B)) within the first n - n//10 bytes;
AdamW (betas 0.9, 0.95; weight decay on parameters of 2 or more dims, none
on the rest), linear warmup then cosine decay to --min-lr; the gradient
norm clipped to --grad-clip. --out receives the final model
(save_pretrained, rank 0) and result.json: per-step milliseconds (the
slowest rank), tokens/s, peak RSS (VmHWM) per rank, losses.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import run_ranks, vm_kib  # noqa: E402

MASK64 = (1 << 64) - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def batch(data, seed, step, rank, world, b, block):
    train = len(data) - len(data) // 10
    span = train - block
    state = (seed * 0x100000001B3 + step) & MASK64
    rows = []
    for i in range(world * b):
        state, r = splitmix64(state)
        if rank * b <= i < (rank + 1) * b:
            off = r % span
            rows.append(data[off:off + block + 1])
    t = torch.tensor([list(r) for r in rows], dtype=torch.long)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def lr_at(a, step):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    decay = max(1, a.steps - a.warmup)
    progress = min(1.0, (step - a.warmup) / decay)
    return a.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (a.lr - a.min_lr)



def rank_main(rank, world, port, a, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as tdist-run sets OMP_NUM_THREADS
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import GPT2LMHeadModel
    baseline = vm_kib("VmRSS")
    model = GPT2LMHeadModel.from_pretrained(a.init, dtype=torch.float32)
    model.train()
    if a.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if a.precision == "bf16" else MixedPrecisionPolicy()
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        wrapped = model
    else:
        if a.precision == "bf16":
            sys.exit("bf16 is FSDP's mixed precision (as in examples/gpt.cpp)")
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=a.weight_decay), dict(params=no_decay, weight_decay=0.0)],
                            lr=a.lr, betas=(0.9, 0.95))
    data = open(a.data, "rb").read()
    times, losses = [], []
    for step in range(a.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(a, step)
        x, y = batch(data, a.seed, step, rank, world, a.batch_size, a.block_size)
        opt.zero_grad(set_to_none=True)
        logits = wrapped(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        l = loss.detach().double().reshape(1)
        dist.all_reduce(l)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(l.item() / world)
    per_step = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    rss = torch.zeros(world, dtype=torch.float64)
    rss[rank] = vm_kib("VmHWM") * 1024.0
    dist.all_reduce(rss)
    if a.mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = model.state_dict()
    if rank == 0:
        plain = GPT2LMHeadModel.from_pretrained(a.init, dtype=torch.float32)
        plain.load_state_dict(sd)
        plain.save_pretrained(a.out)
        warm = per_step[min(len(times) - 1, 2):] if times else per_step
        ms = statistics.median(warm.tolist()) if times else 0.0
        tokens = a.batch_size * a.block_size * world
        result = dict(impl=f"PyTorch {torch.__version__} {a.mode.upper()} {a.precision} (gloo)", world_size=world,
                      steps=a.steps, step_ms=per_step.tolist(), ms_per_step=ms,
                      tokens_per_s=tokens / (ms / 1e3) if ms > 0 else 0.0, peak_rss_bytes=rss.tolist(),
                      rss_before_model_bytes=baseline * 1024, train_loss=losses)
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=["fsdp2", "ddp"], default="fsdp2")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    r = run_ranks(rank_main, a)
    print(f"# {r['impl']}, world {a.world_size}: {r['tokens_per_s']:.0f} tokens/s ({r['ms_per_step']:.1f} ms/step), "
          f"peak RSS per rank " + " ".join(f"{b / 2**20:.0f} MiB" for b in r["peak_rss_bytes"]) +
          f", final loss {r['train_loss'][-1] if r['train_loss'] else 0:.6f}")


if __name__ == "__main__":
    main()
