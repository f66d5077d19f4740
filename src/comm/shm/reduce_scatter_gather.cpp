// The large (staged) path of all_reduce and reduce.
//
// Each round handles one chunk of count elements, split into size()
// segments; rank r reduces segment r. In round j every rank posts the
// segments of chunk j the others reduce, plus its reduced segment of chunk
// j-1; after the barrier it reduces its segment of chunk j (straight into
// the next round's buffer) and copies the others' reduced segments of chunk
// j-1 into its output. One barrier per chunk, plus one to drain.
//
// An all_reduce (root < 0) publishes its symmetric key and its single-copy
// offer with its descriptor (agree_on_path, path.h): when every rank's key
// is the same non-zero one, the op continues as SymmetricAllReduce::run (in
// place, symmetric_allreduce.h); when every rank offered, as cma_all_reduce
// (cma.h); else on the staging path.
#include <algorithm>
#include <utility>
#include <vector>

#include "comm/reduce.h"
#include "comm/shm/algorithms.h"
#include "comm/shm/path.h"
#include "comm/shm/symmetric_allreduce.h"

namespace tdist::comm::shm::algo {

void reduce_scatter_gather(Rounds& rounds, const PieceWalker& walk, DataType t, DataType wire, ReduceOp op,
                           const OpDesc& desc, int root, Deadline d, SymmetricAllReduce* sym, CmaChannel* cma) {
  const int n = rounds.size(), me = rounds.rank();
  const size_t es = dtype_size(t), ws = dtype_size(wire);
  const size_t count = walk.count();
  // Buffer layout per round: [n segments of seg elements][reduced segment].
  const size_t seg = std::max<size_t>(1, rounds.round_bytes() / (n + 1) / kAlign * kAlign / ws);
  const size_t chunk = seg * n;
  const size_t chunks = std::max<size_t>(1, (count + chunk - 1) / chunk);
  const size_t red_off = seg * n * ws;
  const bool want_output = root < 0 || root == me;
  RankPointers inputs(n);
  alignas(64) uint16_t scratch[kScratchElems];  // wire values (16-bit when narrower)
  // Chunk j's elements split evenly over the ranks (in whole cache lines),
  // so a tensor smaller than a chunk still shares the work.
  const size_t line = std::max<size_t>(1, kAlign / ws);
  auto seg_range = [&](size_t j, int s) {
    const size_t chunk_begin = j * chunk;
    const size_t chunk_len = std::min(chunk, count - std::min(count, chunk_begin));
    const size_t per = (chunk_len + n - 1) / n;
    const size_t per_aligned = std::min(seg, (per + line - 1) / line * line);
    const size_t begin = std::min(chunk_len, s * per_aligned);
    const size_t end = std::min(chunk_len, begin + per_aligned);
    return std::make_pair(chunk_begin + begin, end - begin);
  };
  // Posts the segments of chunk j that the other ranks reduce.
  auto post = [&](size_t j) {
    for (int s = 0; s < n; ++s) {
      if (s == me) continue;
      auto [begin, len] = seg_range(j, s);
      uint8_t* to = rounds.mine() + s * seg * ws;
      walk.for_each(begin, len, [&](uint8_t* p, size_t off, size_t k) {
        convert(to + off * ws, wire, p, t, k);
      });
    }
  };
  // One contiguous piece, carried as is: it may go single-copy.
  uint8_t* whole = nullptr;
  if (cma && root < 0 && wire == t) {
    int pieces = 0;
    walk.for_each(0, count, [&](uint8_t* p, size_t, size_t) {
      whole = p;
      ++pieces;
    });
    if (pieces != 1) whole = nullptr;
  }
  const uint64_t* sym_key = sym ? sym->key() : nullptr;
  // Counted in its size's bucket on every rank, whole or not (crossover.h).
  CrossoverTrial trial = CmaChannel::trial(root < 0 && wire == t ? cma : nullptr, Crossover::Op::kAllReduce,
                                           count * es, whole != nullptr);
  const PathOffer offer{sym_key, cma, trial.offers(), whole, whole, &trial};
  const Path path = agree_on_path(rounds, offer, desc, d, [&] { post(0); });
  if (path == Path::kSymmetric) {
    sym->run(rounds, count, t, wire, op, desc, d);
    return;
  }
  if (path == Path::kSingleCopy) {
    cma_all_reduce(rounds, *cma, whole, count, t, op, desc, d);
    return;
  }
  for (size_t j = 0; j <= chunks; ++j) {
    if (j > 0) {
      if (j < chunks) post(j);
      // (The reduced segment of chunk j-1 was written into this buffer at
      // the end of the previous round.)
      rounds.barrier_round(desc, d);
    }
    if (j < chunks) {
      auto [begin, len] = seg_range(j, me);
      uint8_t* reduced = rounds.mine() + red_off;  // the next round's buffer
      walk.for_each(begin, len, [&](uint8_t* p, size_t off, size_t k) {
        if (wire == t) {
          for (int r = 0; r < n; ++r) inputs[r] = r == me ? p : rounds.theirs(r) + me * seg * ws + off * ws;
          reduce_many(reduced + off * ws, inputs.data(), n, k, t, op, n, want_output ? p : nullptr);
          return;
        }
        // Narrow this rank's values a block at a time, reduce, widen back.
        for (size_t b = 0; b < k; b += kScratchElems) {
          const size_t m = std::min(kScratchElems, k - b);
          convert(scratch, wire, p + b * es, t, m);
          for (int r = 0; r < n; ++r) {
            inputs[r] = r == me ? static_cast<const void*>(scratch)
                                : rounds.theirs(r) + me * seg * ws + (off + b) * ws;
          }
          uint8_t* out = reduced + (off + b) * ws;
          reduce_many(out, inputs.data(), n, m, wire, op, n);
          if (want_output) convert(p + b * es, t, out, wire, m);
        }
      });
    }
    if (j >= 1 && want_output) {
      for (int r = 0; r < n; ++r) {
        if (r == me) continue;
        auto [begin, len] = seg_range(j - 1, r);
        const uint8_t* from = rounds.theirs(r) + red_off;
        walk.for_each(begin, len, [&](uint8_t* p, size_t off, size_t k) {
          convert(p, t, from + off * ws, wire, k);
        });
      }
    }
  }
  if (trial.ends_with_barrier()) rounds.barrier_round(desc, d);
}

}  // namespace tdist::comm::shm::algo
