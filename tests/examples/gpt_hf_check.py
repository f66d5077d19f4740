"""Hugging Face's GPT2LMHeadModel beside tdist's examples/gpt.cpp (run by
tests/examples/gpt_test.cpp with the .venv's Python: torch 2.x and
transformers, installed by scripts/python-ref.sh).

  make DIR --n-layer L --n-head H --n-embd E --n-positions P [--vocab V] [--seed S] [--max-shard-size N]
      a randomly initialised GPT2LMHeadModel (dropout 0) saved with save_pretrained
  val DIR DATA BLOCK
      prints val_loss=<mean cross-entropy> over the validation windows of DATA,
      as gpt.cpp defines them (the last n//10 bytes, consecutive windows of BLOCK+1)
  load DIR
      from_pretrained(DIR): fails on any missing, unexpected or mismatched key
      and unless every parameter equals the files' tensor bit for bit; prints
      the model's parameter count
  set CONFIG KEY JSON
      sets one field of a config.json (to a JSON value, e.g. 1e12 or "llama")
  same DIR_A DIR_B
      prints the largest relative difference between the two models' weights
      (max |a - b| / max |b| over each tensor, the worst tensor; the key third
      of every attn.c_attn.bias left out: its exact gradient is zero, since
      softmax does not change when every score of a row gains q . b_k, so
      Adam steps on rounding noise there and two exact runs part by ~1e-4)
"""
import json
import os
import sys

# torch and transformers take seconds to import: only the commands that
# need them do (set needs neither).


def make(argv):
    import argparse

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--n-positions", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--old-masks", action="store_true",
                   help="add the causal-mask buffers older GPT-2 checkpoints carry (h.N.attn.bias, h.N.attn.masked_bias)")
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=a.n_positions, n_embd=a.n_embd, n_layer=a.n_layer,
                     n_head=a.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=a.vocab - 1, eos_token_id=a.vocab - 1)
    model = GPT2LMHeadModel(cfg)
    model.save_pretrained(a.dir, max_shard_size=a.max_shard_size)
    if a.old_masks:
        from safetensors.torch import load_file, save_file

        path = a.dir + "/model.safetensors"
        sd = load_file(path)
        prefix = next(k for k in sd if k.endswith("h.0.ln_1.weight"))[: -len("h.0.ln_1.weight")]
        n = a.n_positions
        for i in range(a.n_layer):
            sd[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
            sd[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        save_file(sd, path, metadata={"format": "pt"})


def windows(data, block):
    import torch

    raw = open(data, "rb").read()
    val = raw[len(raw) - len(raw) // 10:]
    n = len(val) // (block + 1)
    t = torch.tensor(list(val[: n * (block + 1)]), dtype=torch.long).view(n, block + 1)
    return t[:, :-1], t[:, 1:]


def val(argv):
    import torch
    from transformers import GPT2LMHeadModel

    d, data, block = argv[0], argv[1], int(argv[2])
    model = GPT2LMHeadModel.from_pretrained(d, dtype=torch.float32).eval()
    x, y = windows(data, block)
    total = 0.0
    with torch.no_grad():
        for i in range(0, x.shape[0], 64):
            logits = model(x[i:i + 64]).logits.float()
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i:i + 64].reshape(-1),
                                                       reduction="sum").double().item()
    print("val_loss=%.8f" % (total / y.numel()))


def file_tensors(d):
    from safetensors.torch import load_file

    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(d, f)))
    return out


def load(argv):
    import torch
    from transformers import GPT2LMHeadModel

    d = argv[0]
    model, info = GPT2LMHeadModel.from_pretrained(d, output_loading_info=True, dtype=torch.float32)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit("from_pretrained(%s): %s" % (d, bad))
    files = file_tensors(d)
    sd = model.state_dict()
    for name, t in files.items():
        if name not in sd:
            sys.exit("%s: the file's %s is not in the model" % (d, name))
        if not torch.equal(sd[name], t.to(sd[name].dtype)):
            sys.exit("%s: %s differs from the file" % (d, name))
    if not torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"]):
        sys.exit("lm_head is not tied to wte")
    print("parameters=%d" % sum(p.numel() for p in model.parameters()))


def same(argv):
    import torch

    a, b = file_tensors(argv[0]), file_tensors(argv[1])
    if set(a) != set(b):
        sys.exit("different names: %s" % sorted(set(a) ^ set(b)))
    worst = 0.0
    for k in a:
        if k.endswith("attn.c_attn.bias"):
            e = a[k].shape[0] // 3
            a[k], b[k] = torch.cat([a[k][:e], a[k][2 * e:]]), torch.cat([b[k][:e], b[k][2 * e:]])
        diff = (a[k].double() - b[k].double()).abs().max().item()
        scale = max(a[k].double().abs().max().item(), 1e-12)
        worst = max(worst, diff / scale)
    print("max_rel_diff=%.3e" % worst)


def set_field(argv):
    path, key, value = argv
    cfg = json.load(open(path))
    cfg[key] = json.loads(value)
    json.dump(cfg, open(path, "w"), indent=2)


if __name__ == "__main__":
    {"make": make, "val": val, "load": load, "same": same, "set": set_field}[sys.argv[1]](sys.argv[2:])
