// The single-copy collectives (cma.h), once agree_on_path chose them: every
// rank moves its own part straight between its memory and the peers', a
// chunk at a time (CmaChannel::kChunkBytes), and one closing barrier tells
// everyone that all transfers into their buffers are done and nobody reads
// theirs any more.
//
// - all_reduce (in place): rank r owns share r of the buffer. Per chunk of
//   it, it reads the peers' chunk into scratch, reduces all n inputs in
//   rank order into its own buffer, and writes the result into every
//   peer's buffer at the same place. Only rank r reads or writes share r
//   of anyone's buffer, so nothing races; every element is reduced once,
//   so every rank gets the same bits. Memory traffic: each input read once,
//   each output written once (the model's 2nS).
// - reduce_scatter: rank r reads share r of every peer's input, reduces it
//   with its own into its output.
// - all_gather: rank r writes its input into slot r of every rank's output
//   (the chunk read once, written n times).
// - broadcast: the copy is split so that two cores make it at once. Every
//   rank but the root reads the head of the root's buffer into its own, in
//   one call (nothing is reduced or forwarded, so no chunk needs to stay in
//   cache), while the root writes the tail, 1/n of the buffer in whole
//   cache lines, into each of them (from 32 KiB); each moves (n - 1)/n of
//   it at world n.
//   On the Intel Xeon VM at world 2: 1 MiB 45 -> 17.5 us, 256 KiB 9.2 ->
//   5.6, 64 KiB 3.5 -> 2.6 (docs/benchmarks.md, part 7), where the root
//   used to move nothing.
#include <algorithm>
#include <vector>

#include "comm/reduce.h"
#include "comm/shm/algorithms.h"
#include "comm/shm/cma.h"
#include "util/bytes.h"

namespace tdist::comm::shm::algo {

namespace {

// Elements per transfer, in whole cache lines.
size_t chunk_elems(size_t es) { return std::max<size_t>(kAlign / es, CmaChannel::kChunkBytes / es); }

// Reduces count elements of this rank's `mine` with every peer's share,
// read chunk by chunk from remote(q) (the peer's address of `mine`'s first
// element) into scratch, one chunk per peer, in rank order into out; then
// calls after_chunk(at, k) for the elements just reduced.
template <typename Remote, typename AfterChunk>
void reduce_from_peers(Rounds& rounds, CmaChannel& cma, const uint8_t* mine, uint8_t* out, size_t count,
                       DataType t, ReduceOp op, const OpDesc& desc, Remote&& remote, AfterChunk&& after_chunk) {
  const int n = rounds.size(), me = rounds.rank();
  const size_t es = dtype_size(t), step = chunk_elems(es);
  uint8_t* scratch = cma.scratch(static_cast<size_t>(n) * step * es);
  RankPointers inputs(n);
  for (size_t at = 0; at < count; at += step) {
    const size_t k = std::min(step, count - at);
    for (int q = 0; q < n; ++q) {
      if (q == me) {
        inputs[q] = mine + at * es;
        continue;
      }
      uint8_t* buf = scratch + static_cast<size_t>(q) * step * es;
      cma.read(rounds, q, buf, remote(q) + at * es, k * es, desc);
      inputs[q] = buf;
    }
    reduce_many(out + at * es, inputs.data(), n, k, t, op, n);
    after_chunk(at, k);
  }
}

}  // namespace

void cma_all_reduce(Rounds& rounds, CmaChannel& cma, void* buf, size_t count, DataType t, ReduceOp op,
                    const OpDesc& desc, Deadline d) {
  const int n = rounds.size(), me = rounds.rank();
  const size_t es = dtype_size(t), line = std::max<size_t>(1, kAlign / es);
  const size_t per = ((count + n - 1) / n + line - 1) / line * line;
  const size_t begin = std::min(count, me * per), len = std::min(count, begin + per) - begin;
  auto* mine = static_cast<uint8_t*>(buf) + begin * es;
  reduce_from_peers(rounds, cma, mine, mine, len, t, op, desc, [&](int q) { return cma.in_of(q) + begin * es; },
                    [&](size_t at, size_t k) {
                      for (int q = 0; q < n; ++q) {
                        if (q != me) cma.write(rounds, q, mine + at * es, cma.in_of(q) + (begin + at) * es, k * es, desc);
                      }
                    });
  rounds.barrier_round(desc, d);
}

void cma_reduce_scatter(Rounds& rounds, CmaChannel& cma, const void* in, void* out, size_t count, DataType t,
                        ReduceOp op, const OpDesc& desc, Deadline d) {
  const size_t share = static_cast<size_t>(rounds.rank()) * count * dtype_size(t);
  reduce_from_peers(rounds, cma, static_cast<const uint8_t*>(in) + share, static_cast<uint8_t*>(out), count, t, op,
                    desc, [&](int q) { return cma.in_of(q) + share; }, [](size_t, size_t) {});
  rounds.barrier_round(desc, d);
}

void cma_all_gather(Rounds& rounds, CmaChannel& cma, const void* in, void* out, size_t bytes, const OpDesc& desc,
                    Deadline d) {
  const int n = rounds.size(), me = rounds.rank();
  const auto* src = static_cast<const uint8_t*>(in);
  uint8_t* own = static_cast<uint8_t*>(out) + static_cast<size_t>(me) * bytes;
  for (size_t at = 0; at < bytes; at += CmaChannel::kChunkBytes) {
    const size_t k = std::min(CmaChannel::kChunkBytes, bytes - at);
    if (own != src) detail::copy_bytes(own + at, src + at, k);
    for (int q = 0; q < n; ++q) {
      if (q != me) cma.write(rounds, q, src + at, cma.out_of(q) + static_cast<size_t>(me) * bytes + at, k, desc);
    }
  }
  rounds.barrier_round(desc, d);
}

void cma_broadcast(Rounds& rounds, CmaChannel& cma, void* buf, size_t bytes, int root, const OpDesc& desc,
                   Deadline d) {
  const int n = rounds.size();
  // Below kSplitBytes one system call more on the root costs more than
  // half the copy saves (world 2, Intel Xeon VM: 8 KiB 1.31 -> 1.65 us
  // split, 16 KiB 1.68 -> 1.73, 32 KiB 2.49 -> 2.00).
  constexpr size_t kSplitBytes = 32 * 1024;
  // What the root writes into each other rank, and what each reads itself.
  const size_t tail = bytes < kSplitBytes ? 0 : bytes / n / kAlign * kAlign;
  const size_t head = bytes - tail;
  auto* p = static_cast<uint8_t*>(buf);
  if (rounds.rank() != root) {
    cma.read(rounds, root, p, cma.in_of(root), head, desc);
  } else if (tail > 0) {
    for (int q = 0; q < n; ++q) {
      if (q != root) cma.write(rounds, q, p + head, cma.in_of(q) + head, tail, desc);
    }
  }
  rounds.barrier_round(desc, d);
}

}  // namespace tdist::comm::shm::algo
