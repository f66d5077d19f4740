#!/usr/bin/env python3
"""A picture of one training step from tdist's timeline (TDIST_TRACE).

    .venv/bin/python bench/plot_timeline.py TRACE [--step N] [--out timeline.png] [--title T]

TRACE: a merged trace (tdist-trace merge) or a directory of per-rank
traces (*.rank-<R>.json). Draws step N (default: the middle one) of every
rank: one row per track (the training thread, each group's worker, the
checkpoint writer), a bar per span, coloured by kind: compute (an FSDP
unit's forward or backward), communication (an op's run), waiting (the
training thread blocked on an op), checkpoint. What Perfetto shows, as a
PNG for the README.

Needs matplotlib (scripts/python-ref.sh bench installs it into .venv).
"""
import argparse
import glob
import json
import os
import sys

COLOURS = {"compute": "#4c9a2a", "comm": "#1f6fb4", "p2p": "#1f6fb4", "wait": "#d1495b", "checkpoint": "#edae49"}


def load(path):
    files = sorted(glob.glob(os.path.join(path, "*.rank-*.json"))) if os.path.isdir(path) else [path]
    if not files:
        sys.exit(f"plot_timeline: no *.rank-<R>.json traces in {path}")
    events = []
    for f in files:
        with open(f) as fh:
            events += json.load(fh)["traceEvents"]
    return events


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--step", type=int)
    ap.add_argument("--out", default="timeline.png")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = load(a.trace)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    steps = {}  # step -> {rank: ts}
    for e in events:
        if e.get("cat") == "step" and e.get("ph") == "i":
            steps.setdefault(int(e["name"].split()[1]), {})[e["pid"]] = e["ts"]
    if len(steps) < 2:
        sys.exit("plot_timeline: fewer than two steps in the trace")
    order = sorted(steps)
    n = a.step if a.step is not None else order[len(order) // 2]
    if n not in steps or n + 1 not in steps:
        sys.exit(f"plot_timeline: step {n} and the one after it are not both in the trace (steps {order[0]}-{order[-1]})")
    lo, hi = min(steps[n].values()), max(steps[n + 1].values())
    spans = [e for e in events if e.get("ph") == "X" and e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo]
    tracks = sorted({(e["pid"], e["tid"]) for e in spans})
    fig, ax = plt.subplots(figsize=(12, 0.9 + 0.6 * len(tracks)))
    for row, key in enumerate(tracks):
        mine = sorted((e for e in spans if (e["pid"], e["tid"]) == key), key=lambda e: (e["ts"], -e.get("dur", 0)))
        open_ends = []  # the ends of the spans enclosing the current one
        for e in mine:
            begin, end = e["ts"], e["ts"] + e.get("dur", 0)
            while open_ends and open_ends[-1] <= begin:
                open_ends.pop()
            depth = len(open_ends)
            open_ends.append(end)
            begin, end = max(begin, lo), min(end, hi)
            cat = e.get("cat", "")
            # A nested span (an inner FSDP unit in its parent, an op inside
            # the wait that ran it) is drawn narrower, on top.
            height = max(0.25, 0.8 - 0.17 * depth)
            colour = COLOURS.get(cat, "#999999")
            if cat == "compute" and depth:
                colour = ["#4c9a2a", "#6fbf4a", "#94d46f", "#b7e59a"][min(depth, 3)]
            ax.barh(row, (end - begin) / 1000, left=(begin - lo) / 1000, height=height, color=colour,
                    edgecolor="white", linewidth=0.3)
            width_ms = (end - begin) / 1000
            fits = int(width_ms / ((hi - lo) / 1000) * 190)  # characters of 6 pt across the bar
            if cat == "compute" and fits >= 6 and depth:
                kind, _, unit = e["name"].partition(" ")
                unit = unit.split("::")[-1].replace("Impl", "")
                label = ("fwd " if kind == "forward" else "bwd ") + unit
                ax.text((begin - lo) / 1000 + width_ms / 2, row, label[:fits], ha="center", va="center", fontsize=6,
                        color="black", clip_on=True)
        for r, ts in steps[n].items():
            if r == key[0]:
                ax.axvline((ts - lo) / 1000, color="#444444", lw=0.6, ls=":")
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([f"rank {p}: {names.get((p, t), f'thread {t}')}" for p, t in tracks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(a.title or f"step {n}")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items() if k != "p2p"], loc="lower right",
              fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"plot_timeline: step {n}, {len(spans)} spans on {len(tracks)} tracks -> {a.out}")


if __name__ == "__main__":
    main()
