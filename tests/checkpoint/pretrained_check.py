"""The Python side of pretrained_test.cpp (run with the .venv's torch 2.x and transformers).

  small PT       torch.save of a small module's state_dict (runs with torch 1.13 too), and
                 of {"model": state_dict, "step": 3} beside it (PT's stem + "-wrapped.pt")
  make OUT       writes the inputs the test loads into OUT:
                   small.pt            torch.save of a small module's state_dict (a tied weight, two
                                       views of one storage, a transposed weight, fp16 and bf16)
                   small.ref.safetensors  the same values, each tensor contiguous and by itself
                   small13.ref.safetensors  the same for small13.pt when there (written by `small`
                                       with torch 1.13 before), read back by this torch
                   gpt2/               GPT2LMHeadModel.save_pretrained, one file
                   gpt2-sharded/       the same model, several shards and the index
                   gpt2.ref.safetensors   its state_dict (lm_head.weight included), contiguous
                   gpt2-base.safetensors  the base model's state_dict (keys without "transformer.")
  check DIR REF  GPT2LMHeadModel.from_pretrained(DIR) loads with nothing missing, unexpected or
                 mismatched, and its state_dict equals REF's tensors bit for bit (dtype too).
Prints "ok" on success; anything else is an exception.
"""
import os
import sys

import torch

CONFIG = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=64, bos_token_id=None, eos_token_id=None)


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: two keys, one storage
        self.proj = torch.nn.Linear(4, 6)
        # Transposed: a [6, 4] view with strides (1, 6).
        self.proj.weight = torch.nn.Parameter(torch.randn(4, 6).t())
        # Two views into one storage, the second at an offset.
        base = torch.randn(30)
        self.a = torch.nn.Parameter(base[:12].view(3, 4))
        self.register_buffer("b", base[12:30].view(6, 3))
        self.f16 = torch.nn.Module()
        self.f16.weight = torch.nn.Parameter(torch.randn(5, 3).to(torch.float16))
        self.b16 = torch.nn.Module()
        self.b16.weight = torch.nn.Parameter(torch.randn(7, 2).to(torch.bfloat16))


def contiguous(sd):
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def small(path):
    torch.manual_seed(7)
    sd = Small().state_dict()
    assert sd["a"].storage().data_ptr() == sd["b"].storage().data_ptr()
    assert sd["emb.weight"].storage().data_ptr() == sd["head.weight"].storage().data_ptr()
    assert not sd["proj.weight"].is_contiguous()
    torch.save(sd, path)
    torch.save({"model": sd, "step": 3}, path[:-3] + "-wrapped.pt")


def make(out):
    from safetensors.torch import save_file

    small(os.path.join(out, "small.pt"))
    for name in ("small", "small13"):
        pt = os.path.join(out, name + ".pt")
        if os.path.exists(pt):
            save_file(contiguous(torch.load(pt, weights_only=True)), os.path.join(out, name + ".ref.safetensors"))

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(8)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    with torch.no_grad():  # biases and LayerNorms away from their 0/1 initial values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(os.path.join(out, "gpt2"))
    model.save_pretrained(os.path.join(out, "gpt2-sharded"), max_shard_size="40KB")
    save_file(contiguous(model.state_dict()), os.path.join(out, "gpt2.ref.safetensors"))
    save_file(contiguous(model.transformer.state_dict()), os.path.join(out, "gpt2-base.safetensors"),
              metadata={"format": "pt"})
    shards = [f for f in os.listdir(os.path.join(out, "gpt2-sharded")) if f.endswith(".safetensors")]
    assert len(shards) >= 3, shards


def check(path, ref):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    model, info = GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(what):
            raise SystemExit(f"{path}: {what}: {info[what]}")
    want = load_file(ref)
    got = model.state_dict()
    if sorted(got) != sorted(want):
        raise SystemExit(f"{path}: keys {sorted(set(got) ^ set(want))} differ")
    for k, v in want.items():
        if got[k].dtype != v.dtype or not torch.equal(got[k], v):
            raise SystemExit(f"{path}: {k} differs")


if __name__ == "__main__":
    if sys.argv[1] == "small":
        small(sys.argv[2])
    elif sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "check":
        for i in range(2, len(sys.argv), 2):
            check(sys.argv[i], sys.argv[i + 1])
    else:
        raise SystemExit("usage: pretrained_check.py small PT | make OUT | check DIR REF [DIR REF ...]")
    print("ok")
