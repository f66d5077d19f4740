// Ring collectives at the wire's minimum over Gloo's pairs: what FSDP's
// gathers and reduce-scatters need across hosts. Each rank sends (N-1)/N
// of the op's full buffer, to its right neighbour, while it receives as
// much from its left: both directions of every link busy at once.
//
// ring_reduce_scatter: Gloo's options API has none (its old
// ReduceScatterHalvingDoubling reduces in place, allocates twice the input
// and sends a third more at power-of-two world sizes above 2), and an
// all-reduce of the whole buffer sends twice what a reduce-scatter needs.
// At step s (0 .. N-2) rank r sends its running sum of chunk (r-s-1) mod N
// to rank r+1 and receives that of chunk (r-s-2) mod N from rank r-1, to
// which it adds its own input's slice; after N-1 steps it holds chunk r
// summed over every rank. The chunks go through in segments of at most
// kSegmentBytes, one segment's ring after another, so the memory it adds
// is one segment (`scratch`, at most one chunk) and, when out overlaps the
// input, one more.
//
// ring_all_gather: Gloo's allgather kept a 100 Mbit/s link busy only two
// thirds of the time at world 2 (bench/slow_link_fsdp.sh; 1.5-1.6x the
// wire time against 1.07-1.12x for the ring reduce-scatter). At step s rank
// r sends chunk (r-s) mod N, its own first and then the one it received at
// step s-1, to rank r+1, and receives chunk (r-s-1) mod N from rank r-1
// straight into its place in the output: no scratch, no copy but its own
// chunk's (none when the input is that chunk of the output already).
//
// Contract: every rank calls them with the same count, dtype, op and tag,
// in the same order as its other ops. ring_reduce_scatter: in holds
// N * count elements, out count; out may be in's own slice (or elsewhere in
// it); the reduction of each element runs in ring order, the same on every
// rank for a given world size. ring_all_gather: in holds `bytes`, out
// N * bytes, in may be out's slice of this rank (or lie apart from out).
// Errors as Gloo raises them (an IoException naming a timeout or a lost
// peer; the backend turns them into tdist's), or TimeoutError; every wait
// ends by `deadline`.
#pragma once

#include <gloo/context.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/backend.h"

namespace tdist::comm::gloo_backend {

inline constexpr size_t kSegmentBytes = size_t{1} << 20;

// op: a pairwise reduction (AVG's sum; the caller divides).
void ring_reduce_scatter(::gloo::Context& context, const void* in, void* out, size_t count, DataType t, ReduceOp op,
                         uint32_t tag, Deadline deadline, std::vector<uint8_t>& scratch);

void ring_all_gather(::gloo::Context& context, const void* in, void* out, size_t bytes, uint32_t tag,
                     Deadline deadline);

}  // namespace tdist::comm::gloo_backend
