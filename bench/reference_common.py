"""Shared by the PyTorch reference benchmarks (bench/torch_*_reference.py)."""
import queue
import socket
import sys
import time


def vm_kib(field):
    """A field of /proc/self/status ("VmRSS", "VmHWM") in KiB; 0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def collect(procs, out, timeout=1800):
    """Rank 0's result; if a rank dies first (its traceback is on stderr),
    stops the others and exits non-zero rather than waiting out the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            dead = [f"rank {r} exited with status {p.exitcode}" for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                sys.exit(f"{sys.argv[0]}: " + (", ".join(dead) if dead else f"no result in {timeout} s"))


def run_ranks(rank_main, args):
    """Runs rank_main(rank, args.world_size, port, args, out) in
    args.world_size forked processes (a free local port for the store) and
    returns rank 0's result (see collect). Fork, explicitly: the default
    start method differs between Python versions, and the ranks need
    nothing from the parent but `args`."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.world_size, port, args, out)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    result = collect(procs, out)
    for p in procs:
        p.join()
    return result
