#!/usr/bin/env bash
# The check a used machine cannot fool: `make test` and `make demo` from a
# fresh clone inside a clean Debian 12 root that holds only what a new machine
# of this project's kind starts with, never this machine's installed packages,
# .venv or build trees.
#
#   scripts/clean-room.sh [options]
#     --commit REV    what to clone (default: HEAD of this checkout)
#     --steps LIST    what to run, in order (default: "test demo")
#     --cache DIR     where the base root and the download caches live
#                     (default: /var/cache/tdist-clean-room)
#     --cold          no shared ccache (default: this machine's ccache, see below)
#     --keep          keep the run's root afterwards (default: removed)
#
# What the clean root holds. Once, debootstrap makes a minimal Debian 12
# (bookworm, --variant=minbase) from this machine's apt mirror, plus make,
# git and ca-certificates: the tools the README's two commands presuppose.
# Every run starts from a copy of that base (an overlay when the kernel has
# one), so a package that one run installs is gone in the next. Everything
# else (compilers, cmake, LibTorch, Python, OpenMPI, the data set, .venv) must
# come from the project's own scripts, as on a new machine. This is stricter
# than a new machine of this kind, whose image also carries g++, cmake and
# Python: a tool that the image happens to hold but the scripts forget fails
# here. The one thing taken from the image is the CUDA toolkit in
# /usr/local/cuda (not a Debian package, part of every machine of this kind,
# and what a CUDA LibTorch's cmake config looks for), bound read-only, with
# the image's loader paths into it; and the configuration through which the
# machine reaches the registries (below).
#
# What it may reuse for speed, none of which can stand in for an install:
#   - this machine's apt sources, and a .deb cache of its own (in --cache);
#   - this machine's pip download cache (~/.cache/pip): pip still installs
#     every wheel into the clone's own .venv;
#   - unless --cold, this machine's ccache (~/.cache/ccache): a hit needs the
#     same compiler bytes and every header it read, found in the clean root
#     (a missing header falls through to a real compile, which fails).
#
# Needs root (debootstrap, mounts, chroot). The root shares this machine's
# network, so do not run it beside another `make test` here (the tests use
# fixed ports). Prints the wall time of each step
# and ends with one line per step; the result is also written to
# CACHE/results/<date>-<commit>.txt, each step's whole output beside it
# (<date>-<commit>-<step>.log). Exits non-zero when a step failed.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
commit=HEAD steps="test demo" cache=/var/cache/tdist-clean-room cold=0 keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) commit=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --cache) cache=$2; shift 2 ;;
    --cold) cold=1; shift ;;
    --keep) keep=1; shift ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "clean-room: unknown option $1 (--help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "clean-room: needs root (debootstrap, mount, chroot)" >&2; exit 2; }

log() { echo "clean-room: $*" >&2; }
hms() { printf '%d min %02d s' $(($1 / 60)) $(($1 % 60)); }

sha=$(git -C "$repo" rev-parse --verify "$commit^{commit}")
short=${sha:0:7}
mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)\/*$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)
mirror=${mirror:-http://deb.debian.org/debian}
base=$cache/base
mkdir -p "$cache"/{apt-archives,results,runs}

# ---- the base root, made once ------------------------------------------------
t0=$SECONDS
if [ ! -f "$base/.tdist-base-ok" ]; then
  command -v debootstrap >/dev/null || { log "installing debootstrap"; apt-get install -y -qq debootstrap >/dev/null; }
  log "making the base root in $base (debootstrap bookworm minbase from $mirror)"
  # A half-made base (debootstrap stopped) may still have proc or sys mounted.
  if [ -d "$base" ]; then
    findmnt -Rrno TARGET --target "$base" 2>/dev/null | grep "^$base/" | sort -r | xargs -r umount -l || true
    rm -rf --one-file-system "$base"
  fi
  debootstrap --variant=minbase --include=make,git,ca-certificates \
    --cache-dir="$cache/apt-archives" bookworm "$base" "$mirror" > "$cache/debootstrap.log" 2>&1 ||
    { tail -n 20 "$cache/debootstrap.log" >&2; log "debootstrap failed"; exit 1; }
  # The same apt sources as this machine (mirror and security updates).
  rm -f "$base/etc/apt/sources.list"
  cp /etc/apt/sources.list.d/*.sources "$base/etc/apt/sources.list.d/" 2>/dev/null ||
    cp /etc/apt/sources.list "$base/etc/apt/sources.list"
  cp /etc/resolv.conf "$base/etc/resolv.conf"
  rm -rf "$base/var/lib/apt/lists/"*
  touch "$base/.tdist-base-ok"
fi
base_secs=$((SECONDS - t0))

# ---- this run's root: a copy of the base -----------------------------------------
run=$cache/runs/$(date -u +%Y%m%dT%H%M%S)-$short
mkdir -p "$run"
cleanup() {
  if mountpoint -q "$run/root"; then umount -l "$run/root" || true; fi
  [ "$keep" -eq 1 ] || rm -rf "$run"
}
trap cleanup EXIT
if mkdir -p "$run"/{upper,work,root} && mount -t overlay overlay \
     -o "lowerdir=$base,upperdir=$run/upper,workdir=$run/work" "$run/root" 2>/dev/null; then
  log "run root: an overlay on the base ($run/root)"
else
  log "run root: a copy of the base (no overlay here)"
  rmdir "$run/root"; cp -a "$base" "$run/root"
fi
root=$run/root

# The clone lives where this checkout does, so compile commands (and ccache's
# keys) are the same as in a build of this checkout.
dest=$root$repo
mkdir -p "$(dirname "$dest")"
git clone -q --no-hardlinks "$repo" "$dest"
git -C "$dest" cat-file -e "$sha^{commit}" 2>/dev/null || git -C "$dest" fetch -q "$repo" "$sha"
git -C "$dest" checkout -q "$sha"
# The machine's own name and loopback names, as on a new machine of this kind
# (configuration of the image, not packages); minbase has no netbase.
for f in /etc/hosts /etc/hostname /etc/services /etc/protocols; do
  [ -f "$f" ] && cp "$f" "$root$f"
done
# How this machine reaches the package registries, which every machine of
# this kind is set up with: the certificate authorities it adds to the
# system's (an egress proxy's), pip's settings and apt's.
mkdir -p "$root/usr/local/share/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$root/etc/pip.conf"
cp /etc/apt/apt.conf.d/* "$root/etc/apt/apt.conf.d/" 2>/dev/null || true
# The image's loader paths into the CUDA toolkit (cuBLAS, cuDNN, …, which
# `import torch` of the CUDA wheel loads from there on a machine of this kind).
for f in /etc/ld.so.conf.d/*.conf; do
  grep -q '^/usr/local/cuda' "$f" 2>/dev/null && cp "$f" "$root/etc/ld.so.conf.d/"
done

pip_cache=${PIP_CACHE_DIR:-$HOME/.cache/pip}
ccache_dir=$(ccache -k cache_dir 2>/dev/null || echo "$HOME/.cache/ccache")
mkdir -p "$pip_cache"

# One step inside the root, in private mounts (gone with the step): proc,
# sys, dev, a fresh /dev/shm the size of this machine's, the caches, the
# CUDA toolkit. The root is a mount point (the overlay, or the copy bound on
# itself): inside a chroot, `unshare -m` (small_devshm_test) and `ip netns`
# (gloo_netns_test.sh) change the propagation of "/", which the kernel
# refuses when "/" is no mount. The environment is a login's, not this
# shell's, plus CI=true as .ci/run sets it: every test must run, none skip.
inside() {
  local cmd=$1
  local shm_size
  shm_size=$(df --output=size -k /dev/shm | tail -n 1 | tr -d ' ')k
  unshare --mount --propagation private -- bash -euc '
    root=$1 shm=$2 archives=$3 pip=$4 ccache=$5 cold=$6 cmd=$7
    mountpoint -q "$root" || mount --bind "$root" "$root"
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"
    mount --rbind /dev "$root/dev"
    mount -t tmpfs -o size="$shm",mode=1777 tmpfs "$root/dev/shm"
    mkdir -p "$root/var/cache/apt/archives" "$root/root/.cache/pip"
    mount --bind "$archives" "$root/var/cache/apt/archives"
    mount --bind "$pip" "$root/root/.cache/pip"
    if [ "$cold" = 0 ] && [ -d "$ccache" ]; then
      mkdir -p "$root/root/.cache/ccache"; mount --bind "$ccache" "$root/root/.cache/ccache"
    fi
    cuda=$(readlink -f /usr/local/cuda 2>/dev/null || true)
    if [ -n "$cuda" ] && [ -d "$cuda" ]; then
      mkdir -p "$root$cuda"; mount --bind -o ro "$cuda" "$root$cuda"
      [ "$cuda" = /usr/local/cuda ] || ln -sfn "$cuda" "$root/usr/local/cuda"
    fi
    exec chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 CI=true \
      PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      ${PIP_DEFAULT_TIMEOUT:+PIP_DEFAULT_TIMEOUT=$PIP_DEFAULT_TIMEOUT} \
      bash -c "update-ca-certificates >/dev/null 2>&1 || echo clean-room: update-ca-certificates failed: downloads through a proxy may fail >&2; ldconfig; $cmd"
  ' inside "$root" "$shm_size" "$cache/apt-archives" "$pip_cache" "$ccache_dir" "$cold" "$cmd"
}

results=()
status=0
for step in $steps; do
  log "make $step in the clean root (clone of $short at $repo)"
  t0=$SECONDS
  set +e
  inside "cd '$repo' && make $step" 2>&1 | tee "$run/$step.log"
  rc=${PIPESTATUS[0]}
  set -e
  secs=$((SECONDS - t0))
  what="rc $rc"
  if [ "$step" = test ]; then
    # test-suites.sh's summary: one line per suite, then the total.
    what="$what; $(sed -n '/^==== make test: one line per suite/,$p' "$run/$step.log" | sed 1d | paste -sd ';' | tr -s ' ' || true)"
  elif [ "$step" = demo ]; then
    what="$what; $(grep -E 'test accuracy' "$run/$step.log" | tail -n 1 | tr -s ' ' || true)"
  fi
  results+=("$(printf 'make %-6s %s  %s' "$step" "$(hms $secs)" "$what")")
  cp "$run/$step.log" "$cache/results/$(date -u +%Y-%m-%d)-$short-$step.log"
  [ "$rc" -eq 0 ] || status=1
done

out=$cache/results/$(date -u +%Y-%m-%d)-$short.txt
{
  echo "clean-room $(date -u '+%Y-%m-%d %H:%M UTC'), commit $sha"
  echo "base root: $( [ "$base_secs" -gt 1 ] && echo "made in $(hms $base_secs)" || echo cached ), ccache: $( [ "$cold" -eq 1 ] && echo cold || echo "shared ($ccache_dir)" )"
  printf '%s\n' "${results[@]}"
} | tee "$out"
exit $status
