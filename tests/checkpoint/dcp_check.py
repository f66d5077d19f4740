"""PyTorch's side of the DCP tests (dcp_test.cpp), run with the venv's torch 2.x.

  save DIR WORLD REF [FORMAT]  FSDP2 (fully_shard per block, then the root) of
                               tests/fsdp/models.h's Net, AdamW, 3 steps, saved with
                               dcp.save({"model", "optim"}) at WORLD ranks (FORMAT:
                               torch_save, safetensors, or titan: torchtitan's keys, the
                               model at the top and the optimizer flattened); REF: the full model and
                               optimizer state as safetensors ("<name>", "optim/<param>/<field>")
  load DIR WORLD OUT LR         DIR (tdist's DCP save) through dcp.load into the FSDP2 Net
                               and AdamW at WORLD ranks; OUT: their full state, as REF;
                               LR: the learning rate the load must give AdamW
  torch_save DIR OUT           dcp_to_torch_save(DIR), its state as REF into OUT
  plain_save DIR               Net and AdamW (amsgrad) in one process: DIR/model.pt, DIR/optim.pt
                               (torch.save(optimizer.state_dict())), DIR/ref.safetensors
  plain_load OPT MODEL OUT     OPT (an optimizer state_dict tdist wrote) through
                               optimizer.load_state_dict; the state by name into OUT
  evil DIR MARKER              a DCP folder whose .metadata runs `touch MARKER` when
                               Python's pickle.load reads it
"""
import os
import shutil
import tempfile
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Block(torch.nn.Module):
    def __init__(self, width=7, hidden=5):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, hidden)
        self.fc2 = torch.nn.Linear(hidden, width)
        self.gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, width), requires_grad=False)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x))) * self.gate


class Net(torch.nn.Module):
    def __init__(self, blocks=3):
        super().__init__()
        self.add_module("in", torch.nn.Linear(6, 7))  # C++'s name (a keyword here)
        for i in range(blocks):
            self.add_module(f"block{i}", Block())
        self.scale = torch.nn.Parameter(torch.ones(1))  # fully_shard takes no 0-d parameter
        self.head = torch.nn.Linear(7, 3)
        self.blocks = blocks

    def forward(self, x):
        h = getattr(self, "in")(x)
        for i in range(self.blocks):
            h = getattr(self, f"block{i}")(h)
        return self.head(h * self.scale)


def rendezvous_file():
    """A fresh FileStore path for init_process_group: no port to pick, so
    no race with another process taking it between pick and bind."""
    return os.path.join(tempfile.mkdtemp(prefix="dcp-check-"), "store")


def save_rank(rank, world, store, out, ref, fmt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    torch.manual_seed(1)
    net = fsdp_net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for step in range(3):
        torch.manual_seed(70 + step)
        x = torch.randn(4 * world, 6)[4 * rank:4 * rank + 4]
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
    msd, osd = get_state_dict(net, opt)
    state = {"model": msd, "optim": osd}
    if fmt == "titan":  # torchtitan's layout: the model at the top, the optimizer flattened, more beside
        import pickle
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        state = dict(msd)
        state.update({"optimizer": get_state_dict(net, opt, options=flat)[1], "lr_scheduler": sched.state_dict(),
                      "dataloader": {f"dp_rank_{rank}": pickle.dumps({"sample_idx": 3})},
                      "train_state": {"step": 3, "ntokens_seen": 1234}})
    if fmt == "safetensors":
        dcp.save(state, storage_writer=FileSystemWriter(out, serialization_format=SerializationFormat.SAFETENSORS))
    else:
        dcp.save(state, checkpoint_id=out)
    if ref:
        write_full(net, opt, ref, rank)
    dist.barrier()
    dist.destroy_process_group()


def write_full(net, opt, path, rank):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    fm, fo = get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        from safetensors.torch import save_file
        tensors = {k: v.contiguous() for k, v in fm.items()}
        for p, fields in fo["state"].items():
            for f, t in fields.items():
                tensors[f"optim/{p}/{f}"] = t.contiguous()
        save_file(tensors, path)
    return fo


def fsdp_net():
    from torch.distributed.fsdp import fully_shard
    net = Net()
    for i in range(net.blocks):
        fully_shard(getattr(net, f"block{i}"))
    fully_shard(net)
    return net


def load_rank(rank, world, store, ckpt, out, lr):
    """tdist's DCP folder into PyTorch's FSDP2 Net and AdamW (dcp.load), the
    full state written to OUT as `save` writes its reference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    torch.manual_seed(123)
    net = fsdp_net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.5)
    net(torch.randn(2, 6)).sum().backward()  # the optimizer's state made, to be overwritten
    opt.step()
    msd, osd = get_state_dict(net, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got_lr = opt.param_groups[0]["lr"]
    if abs(got_lr - lr) > 1e-12:
        raise SystemExit(f"lr {got_lr}, not {lr}")
    write_full(net, opt, out, rank)
    dist.barrier()
    dist.destroy_process_group()


def to_torch_save(ckpt, out):
    """dcp_to_torch_save, then the file's model and optimizer state as a
    safetensors file like `save`'s reference."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    pt = out + ".pt"
    dcp_to_torch_save(ckpt, pt)
    sd = torch.load(pt, weights_only=True)
    tensors = {k: v.contiguous() for k, v in sd["model"].items()}
    for p, fields in sd["optim"]["state"].items():
        for f, t in fields.items():
            tensors[f"optim/{p}/{f}"] = t.contiguous()
    save_file(tensors, out)


def evil(out, marker):
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + marker,))

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(Boom(), f)
    open(os.path.join(out, "__0_0.distcp"), "wb").close()


def dump_plain(net, opt, path):
    """A plain model's state and its optimizer's, by name, as REF."""
    from safetensors.torch import save_file
    tensors = {k: v.detach().clone().contiguous() for k, v in net.state_dict().items()}
    for name, p in net.named_parameters():
        for f, t in opt.state.get(p, {}).items():
            tensors[f"optim/{name}/{f}"] = t.detach().clone().contiguous()
    save_file(tensors, path)


def plain_save(out):
    """Net and AdamW trained 3 steps in one process: out/model.pt
    (state_dict), out/optim.pt (optimizer.state_dict(), keyed by index),
    out/ref.safetensors (both by name)."""
    torch.manual_seed(2)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.03, betas=(0.8, 0.95), amsgrad=True)
    for step in range(3):
        torch.manual_seed(70 + step)
        opt.zero_grad()
        net(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    os.makedirs(out, exist_ok=True)
    torch.save(net.state_dict(), os.path.join(out, "model.pt"))
    torch.save(opt.state_dict(), os.path.join(out, "optim.pt"))
    dump_plain(net, opt, os.path.join(out, "ref.safetensors"))


def plain_load(optim_pt, model_pt, out):
    """A state_dict file tdist wrote into Python's optimizer (load_state_dict),
    then one more step works; the state by name into OUT."""
    net = Net()
    net.load_state_dict(torch.load(model_pt, weights_only=True))
    opt = torch.optim.AdamW(net.parameters(), lr=0.5)
    opt.load_state_dict(torch.load(optim_pt, weights_only=True))
    g = opt.param_groups[0]
    if g["lr"] != 0.03 or tuple(g["betas"]) != (0.8, 0.95) or not g["amsgrad"]:
        raise SystemExit(f"param group {g}")
    dump_plain(net, opt, out)
    net(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()


def spawn(fn, world, *args):
    store = rendezvous_file()
    try:
        mp.spawn(fn, args=(world, store) + args, nprocs=world)
    finally:
        shutil.rmtree(os.path.dirname(store), ignore_errors=True)


def main():
    cmd = sys.argv[1]
    if cmd == "save":
        out, world, ref = sys.argv[2], int(sys.argv[3]), sys.argv[4]
        fmt = sys.argv[5] if len(sys.argv) > 5 else "torch_save"
        spawn(save_rank, world, out, ref, fmt)
    elif cmd == "load":
        ckpt, world, out, lr = sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
        spawn(load_rank, world, ckpt, out, lr)
    elif cmd == "torch_save":
        to_torch_save(sys.argv[2], sys.argv[3])
    elif cmd == "plain_save":
        plain_save(sys.argv[2])
    elif cmd == "plain_load":
        plain_load(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "evil":
        evil(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("unknown command " + cmd)


if __name__ == "__main__":
    main()
