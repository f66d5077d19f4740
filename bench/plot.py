#!/usr/bin/env python3
"""Charts of what `make bench` measured, as PNG files.

    .venv/bin/python bench/plot.py BENCH_DIR [OUT_DIR=BENCH_DIR]

Reads the JSON that the comparison scripts leave in BENCH_DIR and writes,
for each set of results found (a set that is missing is skipped, with a line
saying so):

  collectives.png  busbw against message size, one panel per op (all_reduce,
                   reduce_scatter, all_gather, broadcast): tdist's shm
                   and gloo backends, OpenMPI, PyTorch's Gloo (both versions),
                   and the memory ceiling of tdist's shm (bench/collective_model.h)
                   (bench/compare_collectives.sh: <tool>-<round>.json, medians
                   over the rounds)
  ddp.png          DDP ms/step per variant, tdist against PyTorch of the same
                   LibTorch version (bench/compare_ddp.sh: tdist-ddp.json,
                   torch-ddp.json, tdist2-ddp.json, torch2-ddp.json)
  fsdp.png         FSDP ms/step and peak memory per world size, tdist against
                   PyTorch's FSDP2 and FSDP1 (bench/compare_fsdp.sh:
                   fsdp-compare/summary.json, its timing cases)

Needs matplotlib (scripts/python-ref.sh bench installs it into .venv).
"""
import glob
import json
import os
import re
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLLECTIVE_TOOLS = [  # file prefix, label, style
    ("tdist-shm", "tdist shm", dict(color="#d62728", marker="o", linewidth=2.2)),
    ("tdist-gloo", "tdist gloo", dict(color="#ff9896", marker="o", linestyle="--")),
    ("openmpi", "OpenMPI", dict(color="#1f77b4", marker="s")),
    ("torch-gloo", "PyTorch {v} Gloo", dict(color="#2ca02c", marker="^")),
    ("torch2-gloo", "PyTorch {v} Gloo", dict(color="#98df8a", marker="v")),
]


def load(path):
    """A JSON file, or None (said on stdout) when it cannot be read: a run killed mid-write."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"plot: {path} left out: {e}")
        return None


def rows_of(doc):
    """The list of row objects in one benchmark JSON file (a list, or an object holding one)."""
    if isinstance(doc, list):
        return doc
    for key in ("rows", "results", "runs"):
        if isinstance(doc, dict) and isinstance(doc.get(key), list):
            return doc[key]
    return []


def size_label(b):
    for unit, n in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= n and b % n == 0:
            return f"{b // n} {unit}iB"
    return f"{b} B"


def torch_version(rows, default):
    for r in rows:
        v = r.get("torch_version")
        if v:
            m = re.match(r"(\d+\.\d+)", v)
            if m:
                return m.group(1)
    return default


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_collectives(bench, out):
    series = {}  # tool -> op -> bytes -> [busbw per round]
    ceiling = {}  # op -> bytes -> [ceiling busbw per round]
    versions = {}
    for tool, _, _ in COLLECTIVE_TOOLS:
        for path in sorted(glob.glob(os.path.join(bench, f"{tool}-[0-9]*.json"))):
            rows = rows_of(load(path))
            versions.setdefault(tool, torch_version(rows, "1.13" if tool == "torch-gloo" else "2.x"))
            for r in rows:
                op, b, bw = r.get("op"), r.get("bytes"), r.get("busbw_GBps")
                if op is None or b is None or bw is None:
                    continue
                series.setdefault(tool, {}).setdefault(op, {}).setdefault(int(b), []).append(float(bw))
                frac = r.get("of_ceiling")
                if tool == "tdist-shm" and frac:
                    ceiling.setdefault(op, {}).setdefault(int(b), []).append(float(bw) / float(frac))
    if not series:
        print(f"plot: no collectives results in {bench} (bench/compare_collectives.sh); collectives.png skipped")
        return None
    ops = [op for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
           if any(op in per_op for per_op in series.values())]
    if not ops:
        print(f"plot: no all_reduce, reduce_scatter, all_gather or broadcast results in {bench}; collectives.png skipped")
        return None
    rows = 2 if len(ops) == 4 else 1
    cols = (len(ops) + rows - 1) // rows
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.4 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        if op in ceiling:
            xs = sorted(ceiling[op])
            ax.plot(xs, [statistics.median(ceiling[op][x]) for x in xs], color="black", linestyle=":",
                    linewidth=1.5, label="memory ceiling (shm)")
        for tool, label, style in COLLECTIVE_TOOLS:
            per_size = series.get(tool, {}).get(op)
            if not per_size:
                continue
            xs = sorted(per_size)
            ax.plot(xs, [statistics.median(per_size[x]) for x in xs], label=label.format(v=versions.get(tool, "")),
                    markersize=3.5, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = [x for x in sorted({x for t in series.values() for x in t.get(op, {})}) if (x.bit_length() - 1) % 4 == 0]
        ax.set_xticks(ticks)
        ax.set_xticklabels([size_label(x) for x in ticks], rotation=30, fontsize=8)
        ax.set_title(op)
        ax.set_xlabel("message size (bytes per rank)")
        ax.grid(True, which="major", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("bus bandwidth (GB/s, higher is better)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    shm_files = sorted(glob.glob(os.path.join(bench, "tdist-shm-[0-9]*.json")))
    rounds = len(shm_files)
    world = next((r.get("world_size") for f in shm_files for r in rows_of(load(f)) if r.get("world_size")), 2)
    fig.suptitle(f"Collectives, float32, world size {world}, medians over {rounds} interleaved rounds")
    return save(fig, out, "collectives.png")


def plot_ddp(bench, out):
    files = [("tdist-ddp", "tdist on LibTorch {v} (shm)", "#d62728"), ("torch-ddp", "PyTorch {v} DDP (Gloo)", "#2ca02c"),
             ("tdist2-ddp", "tdist on LibTorch {v} (shm)", "#ff9896"), ("torch2-ddp", "PyTorch {v} DDP (Gloo)", "#98df8a")]
    data, versions, variants = {}, {}, []
    for name, _, _ in files:
        path = os.path.join(bench, name + ".json")
        if not os.path.isfile(path):
            continue
        rows = rows_of(load(path))
        v = torch_version(rows, None)  # PyTorch's rows name their version; tdist's do not
        if v:
            versions[name] = v
        for r in rows:
            data.setdefault(name, {})[r["variant"]] = float(r["ms_per_step"])
            if r["variant"] not in variants:
                variants.append(r["variant"])
    if not data:
        print(f"plot: no DDP results in {bench} (bench/compare_ddp.sh); ddp.png skipped")
        return None
    # tdist's versions and PyTorch's: label each by the version the tdist run of that pair used.
    versions.setdefault("torch-ddp", "1.13")
    versions.setdefault("torch2-ddp", "2.x")
    versions.setdefault("tdist-ddp", versions["torch-ddp"])
    versions.setdefault("tdist2-ddp", versions["torch2-ddp"])
    present = [f for f in files if f[0] in data]
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    width = 0.8 / len(present)
    for i, (name, label, color) in enumerate(present):
        xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(variants))]
        ys = [data[name].get(v, float("nan")) for v in variants]
        ax.bar(xs, ys, width, label=label.format(v=versions[name]), color=color)
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels(variants, rotation=20, fontsize=8)
    ax.set_ylabel("ms per step (lower is better)")
    world = next((r.get("world_size") for r in rows_of(load(os.path.join(bench, present[0][0] + ".json")))), 2)
    ax.set_title(f"DDP step time, MLP 784-1024-1024-10, batch 64 per rank, world size {world}, CPU")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return save(fig, out, "ddp.png")


def plot_fsdp(bench, out):
    path = os.path.join(bench, "fsdp-compare", "summary.json")
    if not os.path.isfile(path):
        print(f"plot: no {path} (bench/compare_fsdp.sh); fsdp.png skipped")
        return None
    runs = [r for r in (load(path) or {}).get("runs", []) if r.get("case", "").startswith("timing")]
    if not runs:
        print(f"plot: {path} holds no timing case; fsdp.png skipped")
        return None
    order = ["tdist", "tdist2", "fsdp2", "fsdp1"]
    labels = {"tdist": "tdist (LibTorch 1.13)", "tdist2": "tdist (LibTorch 2.x)", "fsdp2": "PyTorch FSDP2",
              "fsdp1": "PyTorch FSDP1"}
    colors = {"tdist": "#d62728", "tdist2": "#ff9896", "fsdp2": "#1f77b4", "fsdp1": "#aec7e8"}
    worlds = sorted({r["world_size"] for r in runs})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    present = [k for k in order if any(r["run"] == k for r in runs)]
    width = 0.8 / max(1, len(present))
    for ax, key, ylabel in ((axes[0], "ms_per_step", "ms per step (lower is better)"),
                            (axes[1], "peak_rss_mib", "peak RSS, largest rank (MiB, lower is better)")):
        for i, run in enumerate(present):
            xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(worlds))]
            ys = [next((r[key] for r in runs if r["run"] == run and r["world_size"] == w), float("nan")) for w in worlds]
            ax.bar(xs, ys, width, label=labels.get(run, run), color=colors.get(run))
        ax.set_xticks(range(len(worlds)))
        ax.set_xticklabels([f"world {w}" for w in worlds])
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("FSDP FULL_SHARD, the same model, data and Adam in tdist and PyTorch (CPU, Gloo for PyTorch)")
    return save(fig, out, "fsdp.png")


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(argv) >= 2 else 2
    bench = argv[1]
    out = argv[2] if len(argv) > 2 else bench
    os.makedirs(out, exist_ok=True)
    made = [p for p in (plot_collectives(bench, out), plot_ddp(bench, out), plot_fsdp(bench, out)) if p]
    for p in made:
        print(f"plot: wrote {p}")
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
