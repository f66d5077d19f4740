"""The safetensors package's view of tdist's files, and files of its own
for tdist to read (tests/checkpoint/safetensors_test.cpp runs this with the
project's .venv, where scripts/python-ref.sh installs safetensors 0.8).

  safetensors_check.py read FILE    prints {"tensors": {name: [dtype, shape, crc32 of the data]},
                                    "metadata": {...}} as JSON (the package checks the file whole)
  safetensors_check.py write FILE   writes tensors defined by formulas (see write) with the package's serializer
"""
import ctypes
import json
import struct
import sys
import zlib

import safetensors._safetensors_rust as st


def read(path):
    with open(path, "rb") as f:
        content = f.read()
    tensors = {}
    for name, info in st.deserialize(content):  # raises on anything invalid
        tensors[name] = [info["dtype"], list(info["shape"]), zlib.crc32(info["data"])]
    # The metadata (the package reads it only through a framework: numpy or torch, not installed here).
    n = struct.unpack("<Q", content[:8])[0]
    metadata = json.loads(content[8:8 + n]).get("__metadata__", {})
    print(json.dumps({"tensors": tensors, "metadata": metadata}))


def write(path):
    # py_f32: 0.5 * i for i in 0..5, shape [2, 3]; py_i64: -1000 * i for i in 0..3; py_bf16: the top
    # halves of the float32 values 1.0, -2.0, 0.25; py_u8: 0..7 as [2, 2, 2].
    specs = [
        ("py_f32", "F32", "float32", [2, 3], struct.pack("<6f", *[0.5 * i for i in range(6)])),
        ("py_i64", "I64", "int64", [4], struct.pack("<4q", *[-1000 * i for i in range(4)])),
        ("py_bf16", "BF16", "bfloat16", [3], b"".join(struct.pack("<f", v)[2:] for v in (1.0, -2.0, 0.25))),
        ("py_u8", "U8", "uint8", [2, 2, 2], bytes(range(8))),
    ]
    metadata = {"written_by": "python"}
    keep = [ctypes.create_string_buffer(data, len(data)) for *_, data in specs]  # alive through the call
    tensors = {name: st.TensorSpec(dtype=long_name, shape=shape, data_ptr=ctypes.addressof(buf), data_len=len(data))
               for (name, _, long_name, shape, data), buf in zip(specs, keep)}
    st.serialize_file(tensors, path, metadata)


if __name__ == "__main__":
    {"read": read, "write": write}[sys.argv[1]](sys.argv[2])
