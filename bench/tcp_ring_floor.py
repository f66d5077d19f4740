#!/usr/bin/env python3
"""What plain TCP makes of a ring: the floor under a collective's wire time.

One process per node (bench/slow_link_fsdp.sh starts one in each network
namespace): node k streams BYTES to node k+1 while it takes BYTES from node
k-1, as a ring collective's steps do, over one TCP connection per
neighbour pair (at world size 2 one connection carries both directions, as
Gloo's pair does). All nodes start at the wall-clock time START (the
namespaces share the clock); each prints the seconds it took to receive
the last three quarters of its bytes: the steady rate, once TCP's start
(slow start, the shaper's burst) is behind it, as a training job's busy
connections run. Nothing but bytes of zeros crosses the wire, and every
wait is bounded by TIMEOUT seconds.

    tcp_ring_floor.py --rank K --ips IP0,IP1,... --bytes N --start EPOCH [--port P] [--timeout S]
"""
import argparse
import socket
import sys
import threading
import time

CHUNK = 1 << 20


def connect(ip, port, deadline):
    while True:
        try:
            s = socket.create_connection((ip, port), timeout=max(0.1, deadline - time.time()))
            s.settimeout(max(0.1, deadline - time.time()))
            return s
        except OSError:
            if time.time() >= deadline:
                raise
            time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--ips", required=True)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--start", type=float, required=True)
    ap.add_argument("--port", type=int, default=29890)
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    ips = a.ips.split(",")
    n, k = len(ips), a.rank
    if n < 2 or not 0 <= k < n or a.bytes < 4 * CHUNK:
        sys.exit("tcp_ring_floor.py: needs 2+ nodes, 0 <= rank < nodes and at least %d bytes" % (4 * CHUNK))
    deadline = a.start + a.timeout
    nxt, prv = (k + 1) % n, (k - 1) % n
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((ips[k], a.port))
    srv.listen(2)
    srv.settimeout(max(0.1, deadline - time.time()))
    # Node k connects to k+1 and accepts k-1; at world size 2 node 0's
    # connection to node 1 is the only one, used both ways.
    if n == 2:
        out = connect(ips[nxt], a.port, deadline) if k == 0 else srv.accept()[0]
        inc = out
    else:
        box = {}
        t = threading.Thread(target=lambda: box.update(s=srv.accept()[0]), daemon=True)
        t.start()
        out = connect(ips[nxt], a.port, deadline)
        t.join(max(0.1, deadline - time.time()))
        if "s" not in box:
            sys.exit("tcp_ring_floor.py: node %d: node %d never connected" % (k, prv))
        inc = box["s"]
    for s in {out, inc}:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(max(0.1, deadline - time.time()))
    time.sleep(max(0.0, a.start - time.time()))
    err = []

    def send():
        try:
            buf, left = memoryview(bytes(CHUNK)), a.bytes
            while left > 0:
                left -= out.send(buf[: min(CHUNK, left)])
        except OSError as e:
            err.append("send: %s" % e)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    got, quarter = 0, None
    try:
        while got < a.bytes:
            b = inc.recv(min(CHUNK, a.bytes - got))
            if not b:
                err.append("node %d closed early" % prv)
                break
            got += len(b)
            if quarter is None and got >= a.bytes // 4:
                quarter = (time.monotonic(), got)
    except OSError as e:
        err.append("recv: %s" % e)
    end = time.monotonic()
    t.join(max(0.1, deadline - time.time()))
    if err or t.is_alive():
        sys.exit("tcp_ring_floor.py: node %d: %s" % (k, "; ".join(err) or "the send did not finish"))
    # Seconds for the last three quarters, scaled to them exactly.
    t0, at = quarter
    if at >= a.bytes:
        sys.exit("tcp_ring_floor.py: node %d: the last three quarters came in one read; use more bytes" % k)
    print("%.4f" % ((end - t0) * (a.bytes - a.bytes // 4) / (a.bytes - at)))


if __name__ == "__main__":
    main()
