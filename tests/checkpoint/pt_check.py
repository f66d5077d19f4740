"""Python torch's view of tdist's .pt files, and .pt files of its own for
tdist to read (tests/formats/pt_file_test.cpp runs this with
/usr/bin/python3, torch 1.13, and with the project's .venv, torch 2.x).

  pt_check.py read FILE    torch.load's the file (weights_only=True where
                           this torch has it; torch 1.13's cannot read
                           floats) and prints JSON: {"torch": version,
                           "weights_only": bool, "weights_only_error":
                           why not or null, "value": v}, v
                           tagged: null, {"bool"|"int"|"str": x},
                           {"float": float.hex()}, {"list"|"tuple": [v]},
                           {"dict": [[key, v]]}, {"tensor": dtype, "shape",
                           "stride", "offset", "requires_grad", "param",
                           "values": tolist() flattened}
  pt_check.py write FILE   torch.save's the object of write() below
"""
import inspect
import json
import pickle
import sys

import torch


def describe(v):
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).replace("torch.", ""), "shape": list(v.shape), "stride": list(v.stride()),
                "offset": v.storage_offset(), "requires_grad": v.requires_grad,
                "param": isinstance(v, torch.nn.Parameter), "values": v.detach().reshape(-1).tolist()}
    if isinstance(v, bool):
        return {"bool": v}
    if isinstance(v, int):
        return {"int": v}
    if isinstance(v, float):
        return {"float": v.hex()}
    if isinstance(v, str):
        return {"str": v}
    if isinstance(v, list):
        return {"list": [describe(x) for x in v]}
    if isinstance(v, tuple):
        return {"tuple": [describe(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[k, describe(x)] for k, x in v.items()]}
    raise TypeError(f"unexpected {type(v)}")


def read(path):
    weights_only = "weights_only" in inspect.signature(torch.load).parameters
    error = None
    try:
        value = torch.load(path, **({"weights_only": True} if weights_only else {}))
    except pickle.UnpicklingError as e:
        # torch 1.13's weights_only unpickler lacks BINFLOAT ("Unsupported operand 71"), even for its own
        # files: there, and only for that, load the plain way and say so.
        if not torch.__version__.startswith("1.") or "Unsupported operand 71" not in str(e):
            raise
        weights_only, error = False, str(e)
        value = torch.load(path)
    print(json.dumps({"torch": torch.__version__, "weights_only": weights_only, "weights_only_error": error,
                      "value": describe(value)}))


def write(path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * 0.5 - i)
    base = torch.arange(12, dtype=torch.float32)
    obj = {
        "model": model.state_dict(),  # an OrderedDict with _metadata
        "param": torch.nn.Parameter(torch.tensor([1.5, -2.0])),
        "frozen": torch.nn.Parameter(torch.tensor([3.0]), requires_grad=False),
        "bf16": torch.tensor([1.0, -2.0, 0.25], dtype=torch.bfloat16),
        "base": base,
        "view": base[2:8].view(2, 3).t(),  # base's storage, offset 2, strides (1, 3)
        "i64": torch.tensor([-2**40, 7]),
        "u8": torch.arange(5, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "nested": {"list": [1, 2.5, "x", None, True, (3, -4, 2**40)], "tuple": (), "empty": {}},
        "step": 7,
        "lr": 0.001,
        "name": "tdist \u2713",
    }
    torch.save(obj, path)


if __name__ == "__main__":
    {"read": read, "write": write}[sys.argv[1]](sys.argv[2])
