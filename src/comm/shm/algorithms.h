// The shm collectives, one function per algorithm (as Gloo has one class
// per algorithm), each a sequence of rounds over the staging buffers
// (rounds.h).
//
// Contract, for every function here:
// - Every rank of the group calls it in the same order, with a descriptor
//   from Rounds::begin_op that matches the other ranks' (the first round
//   compares them: CollectiveMismatchError otherwise; an eager op's root
//   may learn of it one op later, rounds.h). The caller makes the
//   descriptor after its argument checks, so an op refused with UsageError
//   takes no sequence number.
// - Called by the backend's collective thread only; not thread-safe.
// - Blocks until done. Errors as the rounds raise them (timeout, dead peer,
//   mismatch, the group's abort), after which the group is aborted.
// - Buffers as Backend (backend.h) describes them; no state is kept between
//   calls, except that the rounds go on counting.
#pragma once

#include <cstddef>
#include <vector>

#include "comm/backend.h"
#include "comm/shm/rounds.h"
#include "comm/shm/symmetric_span.h"

namespace tdist::comm::shm {

class CmaChannel;
class SymmetricAllReduce;

// Elements narrowed at a time into a stack buffer (reduce passes with a
// narrower wire type, the small all-reduce path).
constexpr size_t kScratchElems = 1024;

// One pointer per rank (the inputs of a reduction), on the stack for up
// to 64 ranks: a small op allocates nothing.
class RankPointers {
 public:
  explicit RankPointers(int n) : heap_(n > kOnStack ? n : 0), p_(n > kOnStack ? heap_.data() : stack_) {}
  RankPointers(const RankPointers&) = delete;
  RankPointers& operator=(const RankPointers&) = delete;
  const void** data() { return p_; }
  const void*& operator[](int r) { return p_[r]; }

 private:
  static constexpr int kOnStack = 64;
  const void* stack_[kOnStack];
  std::vector<const void*> heap_;
  const void** p_;
};

namespace algo {

// The pieces hold elements of type t; the staging buffers hold them as
// wire (the same type, or float16/bfloat16 for float32 pieces). With a
// narrower wire every value is narrowed once (as this rank posts or
// reduces it), the reduction runs on wire values exactly as it would on a
// wire buffer, and the result is widened into the pieces.

// all_reduce in one round (the whole input must fit one staging buffer, as
// wire): everyone posts the whole input, everyone reduces all of it in rank
// order (bit-identical results on every rank). allreduce_small.cpp.
void all_reduce_small(Rounds& rounds, const PieceWalker& walk, DataType t, DataType wire, ReduceOp op,
                      const OpDesc& desc, Deadline d);

// reduce to root in one eager round (count elements at buf must fit one
// staging buffer): the others post their input and go on without waiting
// (Rounds::arrive); root waits for each, then reduces in rank order, as
// all_reduce_small does. allreduce_small.cpp.
void reduce_small(Rounds& rounds, void* buf, size_t count, DataType t, ReduceOp op, int root, const OpDesc& desc,
                  Deadline d);

// all_reduce (root < 0) or reduce to root, in chunks: rank r reduces the
// r-th segment of every chunk, one barrier per chunk plus one to drain.
// With sym (all_reduce only, planned for these pieces) the op may continue
// in place as sym->run() when every rank has the same key.
// With cma (all_reduce of one contiguous piece, wire == t) it may go
// single-copy as cma_all_reduce when every rank offers.
// reduce_scatter_gather.cpp.
void reduce_scatter_gather(Rounds& rounds, const PieceWalker& walk, DataType t, DataType wire, ReduceOp op,
                           const OpDesc& desc, int root, Deadline d, SymmetricAllReduce* sym = nullptr,
                           CmaChannel* cma = nullptr);

// root's bytes into every rank's buf, a round per round_bytes; in one
// eager round when they fit one (the root posts them and goes on, the
// others wait for the root alone). With cma, an op large enough for it
// may go single-copy as cma_broadcast when every rank offers (its rounds,
// if staged, are then none eager). broadcast.cpp.
void broadcast(Rounds& rounds, void* buf, size_t bytes, int root, const OpDesc& desc, Deadline d,
               CmaChannel* cma = nullptr);

// Every rank's bytes into out (size() * bytes, rank r's at r * bytes) on
// root, or on every rank when root < 0 (all_gather). in may alias
// out + rank() * bytes. sym_in (all_gather only): in's span when it lies in
// a symmetric block. cma (all_gather only): single-copy when every rank
// offers. gather.cpp.
void gather(Rounds& rounds, const void* in, void* out, size_t bytes, int root, const OpDesc& desc, Deadline d,
            const SymSpan& sym_in = {}, CmaChannel* cma = nullptr);

// root's in (size() * bytes) dealt out, bytes to each rank's out.
// scatter.cpp.
void scatter(Rounds& rounds, const void* in, void* out, size_t bytes, int root, const OpDesc& desc, Deadline d);

// in holds size() * count elements; out receives this rank's count, reduced.
// sym_in: in's span when it lies in a symmetric block; cma: single-copy
// when every rank offers. reduce_scatter.cpp.
void reduce_scatter(Rounds& rounds, const void* in, void* out, size_t count, DataType t, ReduceOp op,
                    const OpDesc& desc, Deadline d, const SymSpan& sym_in = {}, CmaChannel* cma = nullptr);

// The single-copy versions (cma.h), run once agree_on_path chose them;
// each ends with a barrier. cma_collectives.cpp.
void cma_all_reduce(Rounds& rounds, CmaChannel& cma, void* buf, size_t count, DataType t, ReduceOp op,
                    const OpDesc& desc, Deadline d);
void cma_reduce_scatter(Rounds& rounds, CmaChannel& cma, const void* in, void* out, size_t count, DataType t,
                        ReduceOp op, const OpDesc& desc, Deadline d);
void cma_all_gather(Rounds& rounds, CmaChannel& cma, const void* in, void* out, size_t bytes, const OpDesc& desc,
                    Deadline d);
void cma_broadcast(Rounds& rounds, CmaChannel& cma, void* buf, size_t bytes, int root, const OpDesc& desc,
                   Deadline d);

// Backend::all_to_all; a first round swaps the sizes, and senders and
// receivers that disagree raise CollectiveMismatchError. all_to_all.cpp.
void all_to_all(Rounds& rounds, const void* in, const std::vector<size_t>& send_bytes,
                const std::vector<size_t>& send_offsets, void* out, const std::vector<size_t>& recv_bytes,
                const std::vector<size_t>& recv_offsets, const OpDesc& desc, Deadline d);

}  // namespace algo
}  // namespace tdist::comm::shm
