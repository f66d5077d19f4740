// Which path an op takes, decided by every rank together with the op's
// first round: in place over symmetric memory (symmetric_span.h,
// symmetric_allreduce.h), single-copy through CMA (cma.h), or through the
// staging buffers (rounds.h).
//
// Each rank publishes its symmetric key and its single-copy offer, if it
// has them, with the op's descriptor (whose flags say which it has: a
// small op's first round so stays one cache line), posts the staging
// path's round 0 unless it has a key or an offer, and passes the first
// barrier. Then, the same on
// every rank: symmetric when every rank has the same non-zero key; else
// single-copy when every rank offered and CMA works between them (the
// first such op probes, with one more barrier round); else staged, and
// when some rank skipped round 0, everyone posts it (again) and passes one
// more barrier.
//
// Contract: collective; raises as Rounds does (CollectiveMismatchError from
// the first barrier included). After kSymmetric and kSingleCopy the op must
// end with a barrier_round; after kStaged, round 0 is posted and its
// barrier passed, and the op must end with one more barrier_round when its
// trial says so (CrossoverTrial::ends_with_barrier: rank 0 times it).
#pragma once

#include <cstdint>
#include <functional>

#include "comm/shm/cma.h"
#include "comm/shm/rounds.h"

namespace tdist::comm::shm {

enum class Path { kStaged, kSymmetric, kSingleCopy };

// Below these many bytes in all (the larger of an op's whole input and
// output) an op takes the staging path without agreeing on one; from them
// it agrees, and may go single copy or, where every rank's input is
// symmetric, read the inputs in place. Constants, not TDIST_SHM_CMA_BYTES:
// the ranks must take the same protocol even where that setting differs
// between them. On the Intel Xeon VM (docs/benchmarks.md, part 7):
// - kAgreeBytes, a broadcast's (eager below it: rounds.h; it agrees only
//   in a group where single copy is not refused): a single-copy broadcast
//   timed after a barrier beat the eager staged one from 4 KiB (8 KiB:
//   1.33 against 2.0 us, as the staged one copies each byte twice, one
//   after the other).
// - kStagedBytes, all_gather's and reduce_scatter's (an all_gather whose
//   part a rank fits the box never agrees): single copy lost below 4 KiB
//   (1.6-1.9 us at 1-8 KiB against staged 0.6-1.5), and symmetric inputs
//   read in place, which ends with a second barrier, took 0.70-0.76 us up
//   to 1 KiB against staged 0.48-0.59, but 0.70-0.73 at 2 KiB against
//   0.78.
constexpr size_t kAgreeBytes = 4096;
constexpr size_t kStagedBytes = 2048;

struct PathOffer {
  const uint64_t* sym_key = nullptr;  // {0, 0} or null: none
  CmaChannel* cma = nullptr;          // null: no single-copy
  bool cma_offer = false;             // this rank offers (its trial's offers())
  const void* in = nullptr;           // the op's buffers, for the offer
  const void* out = nullptr;
  CrossoverTrial* trial = nullptr;    // told what was agreed (crossover.h)
};

Path agree_on_path(Rounds& rounds, const PathOffer& offer, const OpDesc& desc, Deadline d,
                   const std::function<void()>& post_round0);

}  // namespace tdist::comm::shm
