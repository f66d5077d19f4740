// A reduce-scatter at the wire's minimum over Gloo's pairs: Gloo's options
// API has none (its old ReduceScatterHalvingDoubling reduces in place,
// allocates twice the input and sends a third more at power-of-two world
// sizes above 2), and an all-reduce of the whole buffer sends twice what a
// reduce-scatter needs.
//
// A ring: at step s (0 .. N-2) rank r sends its running sum of chunk
// (r-s-1) mod N to rank r+1 and receives that of chunk (r-s-2) mod N from
// rank r-1, to which it adds its own input's slice; after N-1 steps it
// holds chunk r summed over every rank. Each rank sends (N-1)/N of its
// input. The chunks go through in segments of at most kSegmentBytes, one
// segment's ring after another, so the memory it adds is one segment
// (`scratch`, at most one chunk) and, when out overlaps the input, one more.
//
// Contract: every rank calls it with the same count, dtype, op and tag, in
// the same order as its other ops; in holds N * count elements, out
// count; out may be in's own slice (or elsewhere in it). The reduction of
// each element runs in ring order, the same on every rank for a given
// world size. Errors as Gloo raises them (an IoException naming a timeout
// or a lost peer; the backend turns them into tdist's), or TimeoutError;
// every wait ends by `deadline`.
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

}  // namespace tdist::comm::gloo_backend
