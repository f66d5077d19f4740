// BlockPool: keeps a few freed blocks of FSDP's big per-unit buffers (full
// parameters, full gradients, reduce-scatter outputs) for the next unit to
// take, instead of handing them back to the C library.
//
// Why: glibc serves blocks of more than 32 MiB (and, after a free, of much
// less) with a fresh mmap, so every gather and every backward of every
// unit would fault its pages in and have the kernel zero them again: on
// the CPU that doubled FULL_SHARD's step time (tdist-bench fsdp, measured).
// Units are usually the same size, so one or two free blocks of that size
// serve them all.
//
// Owns: the free blocks: at most one of each size (a unit's full
// parameters and its full gradients have the same size and are never
// free together for long: a second cached block of that size put
// FULL_SHARD at 1.12x the ZeRO-3 bound at world 3 and bought no speed),
// at most kMaxFreeBlocks, at most twice the largest block asked for in
// bytes. Blocks come from LibTorch's CPU allocator (so memory meters on it
// count them, in use or free).
// Threading: thread-safe (a block may be freed on any thread).
// Lifetime: one per process, never destroyed (blocks may be freed during
// static destruction).
#pragma once

#include <c10/core/Allocator.h>

#include <cstddef>

namespace tdist::detail {

// A block of `nbytes` (uninitialised) whose deleter gives it back to the
// pool, or frees it when the pool is full.
c10::DataPtr take_block(size_t nbytes);
// Gives every free block back to the C library: when no unit will gather
// before the next forward (the Coordinator, once the backward has begun
// for every unit), so the end of a backward, its peak with a model's
// largest unit (the outermost, holding a tied embedding) still gathered,
// does not also hold blocks nobody takes.
void release_pooled_blocks();
// Bytes the pool holds free (for tests and benchmarks).
size_t pooled_bytes();
// Bytes of every block alive, in use or free: the part of the CPU
// allocator's bytes that is FSDP's per-unit buffers (tdist-bench fsdp
// counts the rest as activations).
size_t block_bytes();

}  // namespace tdist::detail
