"""Python torch's view of tdist's checkpoint files (tests/checkpoint/
consolidate_test.cpp runs this with /usr/bin/python3, torch 1.13, and with
the project's .venv, torch 2.x).

  consolidated_check.py module FILE   loads FILE's "model" into Net (the
      nn.Module twin of tests/fsdp/models.h's Net), strictly, and prints
      JSON {"out": Net(x) flattened, "optimizer": kind or null,
      "state": sorted "<param>/<field>" names}
  consolidated_check.py rank FILE     prints JSON {"keys": the file's keys,
      "world_size", "rank", "model": {name: shape}} of a per-rank file
"""
import json
import pickle
import sys

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width=7, hidden=5):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, width), requires_grad=False)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x))) * self.gate


class Net(nn.Module):
    def __init__(self, blocks=3):
        super().__init__()
        self.add_module("in", nn.Linear(6, 7))  # "in" is a keyword: no attribute syntax
        for i in range(blocks):
            self.add_module("block%d" % i, Block())
        self.scale = nn.Parameter(torch.ones(()))
        self.head = nn.Linear(7, 3)
        self.blocks = blocks

    def forward(self, x):
        h = getattr(self, "in")(x)
        for i in range(self.blocks):
            h = getattr(self, "block%d" % i)(h)
        return self.head(h * self.scale)


def load(path):
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        # torch 1.x's weights_only reader cannot read floats at all (not
        # even in torch.save's own files); 2.x's reads them.
        if not torch.__version__.startswith("1."):
            raise
        return torch.load(path)


def main():
    what, path = sys.argv[1], sys.argv[2]
    data = load(path)
    if what == "module":
        net = Net()
        net.load_state_dict(data["model"])  # strict: every name, every shape
        x = torch.arange(12, dtype=torch.float32).reshape(2, 6) / 10
        with torch.no_grad():
            out = net(x).flatten().tolist()
        opt = data.get("optimizer")
        state = sorted(p + "/" + f for p, fields in opt["state"].items() for f in fields) if opt else []
        print(json.dumps({"out": out, "optimizer": opt["optimizer"] if opt else None, "state": state}))
    else:
        md = data["shard_metadata"]
        print(json.dumps({"keys": sorted(data.keys()), "world_size": md["world_size"], "rank": md["rank"],
                          "model": {k: list(v.shape) for k, v in data["model"].items()}}))


main()
