#!/usr/bin/python3
"""Reference numbers: PyTorch's own TCPStore (c10d), one client, same ops as
`tdist-bench store --clients 1`. Needs Debian's python3-torch; tdist itself
does not use Python.

    /usr/bin/python3 bench/torch_store_reference.py [--seconds 2]
"""
import argparse
import time

import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, 1, True)
    value = b"Z" * 64
    server.set("bench/key/0", value)
    print(f"# torch {__import__('torch').__version__} TCPStore, 1 client, 64-byte values")
    print(f"{'store':<12} {'clients':>8} {'op':<5} {'ops/s':>12} {'p50 us':>10} {'p99 us':>10}")
    for op in ("set", "get", "add"):
        lat = []
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            t0 = time.perf_counter()
            if op == "set":
                server.set("bench/key/0", value)
            elif op == "get":
                server.get("bench/key/0")
            else:
                server.add("bench/counter", 1)
            lat.append((time.perf_counter() - t0) * 1e6)
        elapsed = time.perf_counter() - start
        lat.sort()
        p = lambda q: lat[min(len(lat) - 1, int(q / 100 * len(lat)))]
        print(f"{'torch-c10d':<12} {1:>8} {op:<5} {len(lat) / elapsed:>12.0f} {p(50):>10.1f} {p(99):>10.1f}")


if __name__ == "__main__":
    main()
