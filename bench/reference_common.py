"""Shared by the PyTorch reference benchmarks (bench/torch_*_reference.py)."""
import queue
import sys
import time


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
