#!/usr/bin/python3
"""PyTorch's own DCP load (and save) of the model tdist-bench checkpoint
--format dcp saves: the same Sequential of `layers` Linear(w, w), FSDP2
(fully_shard per layer, then the root), Adam; timed beside tdist's in the
same run. For comparison only; tdist does not use Python.

    PYTHON bench/torch_dcp_reference.py --ckpt DIR --width W --layers L
        [--world-size 2] [--repeats 3] --out RESULT.json

Each repeat: dcp.load of DIR (tdist's save) into the model's and
optimizer's state (then set_state_dict), and dcp.save of it into a folder
of its own; the slowest rank's median seconds of each, and rank 0's VmHWM.
"""
import argparse
import json
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist

from reference_common import run_ranks, vm_kib


def rank_main(rank, world, port, args, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, args.width)).sum().backward()
    opt.step()  # the moments exist
    loads, saves = [], []
    own = args.ckpt + "-pytorch"
    for _ in range(args.repeats):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        os.sync()
        dist.barrier()
        t = time.perf_counter()
        dcp.load(state, checkpoint_id=args.ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        dist.barrier()
        loads.append(time.perf_counter() - t)
        os.sync()
        dist.barrier()
        t = time.perf_counter()
        dcp.save(state, checkpoint_id=own)
        dist.barrier()
        saves.append(time.perf_counter() - t)
        if rank == 0:
            shutil.rmtree(own, ignore_errors=True)
        dist.barrier()
    slowest = [None] * world
    dist.all_gather_object(slowest, (statistics.median(loads), statistics.median(saves)))
    if rank == 0:
        out.put({"load_s": max(s[0] for s in slowest), "save_s": max(s[1] for s in slowest),
                 "vm_hwm_kib": vm_kib("VmHWM"), "torch": torch.__version__})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = run_ranks(rank_main, args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
