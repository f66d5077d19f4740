// The collective conformance suite's bodies, shared by the fork-based runner
// (collectives_test.cpp, shm and gloo) and the mpirun-based one
// (mpi_collectives_test.cpp). Each body runs on every rank of a group and
// throws (WORLD_CHECK) on the first wrong result.
//
// Inputs are small integers, so even float16/bfloat16 sums and averages are
// exact and results are compared with at::equal. Sizes cover 0, 1, odd, the
// one-round path and the multi-round path.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "tests/util/world.h"

namespace tdist::test::conformance {

using tdist::ProcessGroup;
using tdist::ReduceOp;

// 8 and 9 float32s: 32 bytes, the most a small round carries beside its
// barrier (the shm backend's box), and one element more.
inline const std::vector<int64_t> kSizes = {0, 1, 7, 8, 9, 1001, 40'000, 300'007};
inline const std::vector<at::ScalarType> kAllTypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt,
                                               at::kLong,  at::kChar,   at::kByte, at::kBool};

inline std::string name(at::ScalarType t) { return c10::toString(t); }
inline bool floating(at::ScalarType t) { return at::isFloatingType(t); }

// Rank r's input for element i: small integers, different per rank.
inline at::Tensor input(int r, int64_t n, at::ScalarType t, ReduceOp op) {
  at::Tensor i = at::arange(n, at::kLong);
  at::Tensor v;
  if (t == at::kBool) {
    v = ((i + r) % 3 == 0);
  } else if (op == ReduceOp::PRODUCT) {
    v = 1 + (i + r) % 2;
  } else if (t == at::kByte) {
    v = (i * 7 + r * 13) % 11;
  } else {
    v = (i * 7 + r * 13) % 11 - 3;
  }
  return v.to(t).contiguous();
}

// What op over every rank's input must give, computed in int64/double.
inline at::Tensor expected(int world, int64_t n, at::ScalarType t, ReduceOp op) {
  const bool wide_float = floating(t);
  auto wide = [&](int r) { return input(r, n, t, op).to(wide_float ? at::kDouble : (t == at::kBool ? at::kBool : at::kLong)); };
  at::Tensor acc = wide(0);
  for (int r = 1; r < world; ++r) {
    at::Tensor x = wide(r);
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::AVG: acc = t == at::kBool ? at::logical_or(acc, x) : acc + x; break;
      case ReduceOp::PRODUCT: acc = t == at::kBool ? at::logical_and(acc, x) : acc * x; break;
      case ReduceOp::MIN: acc = t == at::kBool ? at::logical_and(acc, x) : at::minimum(acc, x); break;
      case ReduceOp::MAX: acc = t == at::kBool ? at::logical_or(acc, x) : at::maximum(acc, x); break;
      case ReduceOp::BAND: acc = at::bitwise_and(acc, x); break;
      case ReduceOp::BOR: acc = at::bitwise_or(acc, x); break;
      case ReduceOp::BXOR: acc = at::bitwise_xor(acc, x); break;
    }
  }
  if (op == ReduceOp::AVG) acc = acc / world;
  return acc.to(t);
}

inline std::vector<ReduceOp> ops_for(at::ScalarType t) {
  if (floating(t)) return {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PRODUCT, ReduceOp::MIN, ReduceOp::MAX};
  return {ReduceOp::SUM, ReduceOp::PRODUCT, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::BAND, ReduceOp::BOR, ReduceOp::BXOR};
}

inline const char* op_name(ReduceOp op) {
  static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};
  return names[static_cast<int>(op)];
}

// AVG inputs are scaled by the world size so the mean stays an integer.
inline at::Tensor input_for(int r, int world, int64_t n, at::ScalarType t, ReduceOp op) {
  at::Tensor x = input(r, n, t, op);
  return op == ReduceOp::AVG ? (x.to(at::kDouble) * world).to(t) : x;
}
inline at::Tensor expected_for(int world, int64_t n, at::ScalarType t, ReduceOp op) {
  if (op != ReduceOp::AVG) return expected(world, n, t, op);
  return expected(world, n, t, ReduceOp::SUM);  // mean of (world * x_r) = sum of x_r
}

#define EQUAL_OR_THROW(got, want, what)                                                               \
  WORLD_CHECK(at::equal(got, want), what << ": got " << (got).slice(0, 0, 8) << " want " << (want).slice(0, 0, 8))

inline void AllReduceEveryDtypeOpAndSize(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (auto t : kAllTypes) {
      for (auto op : ops_for(t)) {
        for (int64_t size : kSizes) {
          at::Tensor x = input_for(r, n, size, t, op);
          pg.all_reduce(x, {op})->wait();
          EQUAL_OR_THROW(x, expected_for(n, size, t, op),
                         "all_reduce " << name(t) << " " << op_name(op) << " x " << size);
        }
      }
    }
}

inline void ReduceToEveryRoot(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (auto t : {at::kFloat, at::kHalf, at::kLong}) {
      for (int root = 0; root < n; ++root) {
        for (int64_t size : {int64_t(0), int64_t(5), int64_t(300'007)}) {
          at::Tensor x = input(r, size, t, ReduceOp::SUM);
          at::Tensor before = x.clone();
          pg.reduce(x, {root, ReduceOp::MAX})->wait();
          if (r == root) {
            EQUAL_OR_THROW(x, expected(n, size, t, ReduceOp::MAX), "reduce " << name(t) << " root " << root);
          } else {
            EQUAL_OR_THROW(x, before, "reduce changed a non-root input");
          }
        }
      }
    }
}

inline void BroadcastFromEveryRoot(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (auto t : {at::kFloat, at::kBFloat16, at::kByte, at::kBool}) {
      for (int root = 0; root < n; ++root) {
        for (int64_t size : {int64_t(0), int64_t(1), int64_t(32), int64_t(33), int64_t(999), int64_t(700'001)}) {
          at::Tensor x = input(r, size, t, ReduceOp::SUM);
          pg.broadcast(x, {root})->wait();
          EQUAL_OR_THROW(x, input(root, size, t, ReduceOp::SUM), "broadcast " << name(t) << " root " << root);
        }
      }
    }
}

inline void AllGatherBothForms(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (auto t : {at::kFloat, at::kLong, at::kHalf}) {
      for (int64_t size : {int64_t(0), int64_t(3), int64_t(8), int64_t(200'003)}) {
        at::Tensor x = input(r, size, t, ReduceOp::SUM);
        std::vector<at::Tensor> outs;
        for (int i = 0; i < n; ++i) outs.push_back(at::empty({size}, x.options()));
        pg.all_gather(outs, x)->wait();
        at::Tensor flat = at::empty({size * n}, x.options());
        pg.all_gather_into_tensor(flat, x)->wait();
        for (int i = 0; i < n; ++i) {
          EQUAL_OR_THROW(outs[i], input(i, size, t, ReduceOp::SUM), "all_gather list, from rank " << i);
          EQUAL_OR_THROW(flat.slice(0, i * size, (i + 1) * size), input(i, size, t, ReduceOp::SUM),
                         "all_gather_into_tensor, from rank " << i);
        }
      }
    }
}

inline void ReduceScatterBothForms(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (auto t : {at::kFloat, at::kBFloat16, at::kInt}) {
      // shm's box holds the shares a rank posts for the others (32 bytes
      // at most): 8 float32s a rank at world 2, 4 at world 3, bf16 9 at
      // world 2 and 4 at world 4; 9 float32s at world 2 are staged.
      for (int64_t size : {int64_t(0), int64_t(1), int64_t(4), int64_t(8), int64_t(9), int64_t(150'001)}) {
        // Each rank contributes n blocks; block b goes to rank b.
        std::vector<at::Tensor> blocks;
        for (int b = 0; b < n; ++b) blocks.push_back(input(r + 10 * b, size, t, ReduceOp::SUM));
        at::Tensor out1 = at::empty({size}, blocks[0].options());
        pg.reduce_scatter(out1, blocks, {ReduceOp::SUM})->wait();
        at::Tensor out2 = at::empty({size}, blocks[0].options());
        pg.reduce_scatter_tensor(out2, at::cat(blocks), {ReduceOp::SUM})->wait();
        at::Tensor want = input(0 + 10 * r, size, t, ReduceOp::SUM).to(at::kDouble);
        for (int q = 1; q < n; ++q) want = want + input(q + 10 * r, size, t, ReduceOp::SUM).to(at::kDouble);
        EQUAL_OR_THROW(out1, want.to(t), "reduce_scatter " << name(t) << " x " << size);
        EQUAL_OR_THROW(out2, want.to(t), "reduce_scatter_tensor " << name(t) << " x " << size);
      }
    }
}

// Per-rank sizes of the coalesced cases' pieces: empty, tiny, odd, and
// large ones (shm takes pieces of 32 KiB and more alone, packs the rest).
inline const std::vector<int64_t> kPieceSizes = {5, 0, 1, 20'011, 3, 9'000, 70'001, 2};

inline void AllGatherCoalescedMatchesEachAllGather(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (auto t : {at::kFloat, at::kLong, at::kHalf}) {
      for (bool in_place : {false, true}) {
        std::vector<at::Tensor> ins, outs;
        for (size_t k = 0; k < kPieceSizes.size(); ++k) {
          const int64_t size = kPieceSizes[k];
          at::Tensor x = input(r + static_cast<int>(k), size, t, ReduceOp::SUM);
          outs.push_back(at::full({size * n}, -7, x.options()));
          if (in_place) {  // the input is this rank's slot of the output
            at::Tensor slot = outs.back().slice(0, r * size, (r + 1) * size);
            slot.copy_(x);
            x = slot;
          }
          ins.push_back(x);
        }
        pg.all_gather_into_tensor_coalesced(outs, ins)->wait();
        for (size_t k = 0; k < kPieceSizes.size(); ++k) {
          const int64_t size = kPieceSizes[k];
          for (int i = 0; i < n; ++i) {
            EQUAL_OR_THROW(outs[k].slice(0, i * size, (i + 1) * size),
                           input(i + static_cast<int>(k), size, t, ReduceOp::SUM),
                           "all_gather_into_tensor_coalesced " << name(t) << (in_place ? " in place" : "")
                                                               << ", piece " << k << " from rank " << i);
          }
        }
      }
    }
}

inline void ReduceScatterCoalescedMatchesEachReduceScatter(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (auto t : {at::kFloat, at::kBFloat16, at::kInt}) {
      for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
        if (op == ReduceOp::AVG && !floating(t)) continue;
        // Piece k of rank q: n blocks, block b (going to rank b) input_for(q + 10 b + k).
        std::vector<at::Tensor> ins, outs;
        for (size_t k = 0; k < kPieceSizes.size(); ++k) {
          const int64_t size = kPieceSizes[k];
          std::vector<at::Tensor> blocks;
          for (int b = 0; b < n; ++b) blocks.push_back(input_for(r + 10 * b + static_cast<int>(k), n, size, t, op));
          ins.push_back(at::cat(blocks));
          outs.push_back(at::full({size}, -7, ins.back().options()));
        }
        pg.reduce_scatter_tensor_coalesced(outs, ins, {op})->wait();
        for (size_t k = 0; k < kPieceSizes.size(); ++k) {
          const int64_t size = kPieceSizes[k];
          // Every rank q's block r of piece k, reduced.
          std::vector<at::Tensor> mine;
          for (int q = 0; q < n; ++q) mine.push_back(input_for(q + 10 * r + static_cast<int>(k), n, size, t, op));
          at::Tensor want = mine[0].to(at::kDouble);
          for (int q = 1; q < n; ++q) {
            want = op == ReduceOp::MAX ? at::maximum(want, mine[q].to(at::kDouble)) : want + mine[q].to(at::kDouble);
          }
          if (op == ReduceOp::AVG) want = want / n;
          EQUAL_OR_THROW(outs[k], want.to(t),
                         "reduce_scatter_tensor_coalesced " << name(t) << " " << op_name(op) << ", piece " << k);
        }
      }
    }
}

inline void GatherAndScatterAtEveryRoot(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (int root = 0; root < n; ++root) {
      for (int64_t size : {int64_t(0), int64_t(2), int64_t(260'000)}) {
        at::Tensor x = input(r, size, at::kFloat, ReduceOp::SUM);
        std::vector<at::Tensor> outs;
        if (r == root) for (int i = 0; i < n; ++i) outs.push_back(at::full({size}, -99.0f));
        pg.gather(outs, x, {root})->wait();
        if (r == root) {
          for (int i = 0; i < n; ++i) EQUAL_OR_THROW(outs[i], input(i, size, at::kFloat, ReduceOp::SUM), "gather from " << i);
        }
        std::vector<at::Tensor> ins;
        if (r == root) for (int i = 0; i < n; ++i) ins.push_back(input(100 + i, size, at::kFloat, ReduceOp::SUM));
        at::Tensor got = at::full({size}, -1.0f);
        pg.scatter(got, ins, {root})->wait();
        EQUAL_OR_THROW(got, input(100 + r, size, at::kFloat, ReduceOp::SUM), "scatter to " << r << " from root " << root);
      }
    }
}

inline void AllToAllEqualAndUnevenSplits(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    // Equal splits: 3 rows of 5 per destination; row value encodes (src, dst).
    at::Tensor in = at::empty({3 * n, 5}, at::kLong);
    for (int d = 0; d < n; ++d) in.slice(0, 3 * d, 3 * d + 3).fill_(r * 100 + d);
    at::Tensor out = at::empty({3 * n, 5}, at::kLong);
    pg.all_to_all_single(out, in)->wait();
    for (int s = 0; s < n; ++s) {
      WORLD_CHECK(out.slice(0, 3 * s, 3 * s + 3).eq(s * 100 + r).all().item<bool>(), "equal split from " << s);
    }
    // Uneven: rank s sends (s + d + big) rows to rank d, some of them many.
    auto rows = [](int s, int d) { return static_cast<int64_t>((s + 2 * d) % 3 == 0 ? 40'000 : s + d); };
    std::vector<int64_t> send_sizes, recv_sizes;
    int64_t send_total = 0, recv_total = 0;
    for (int d = 0; d < n; ++d) {
      send_sizes.push_back(rows(r, d));
      send_total += rows(r, d);
      recv_sizes.push_back(rows(d, r));
      recv_total += rows(d, r);
    }
    at::Tensor uin = at::empty({send_total, 2}, at::kFloat);
    int64_t off = 0;
    for (int d = 0; d < n; ++d) {
      uin.slice(0, off, off + rows(r, d)).fill_(static_cast<float>(r * 10 + d));
      off += rows(r, d);
    }
    at::Tensor uout = at::full({recv_total, 2}, -1.0f);
    pg.all_to_all_single(uout, uin, recv_sizes, send_sizes)->wait();
    off = 0;
    for (int s = 0; s < n; ++s) {
      WORLD_CHECK(uout.slice(0, off, off + rows(s, r)).eq(static_cast<float>(s * 10 + r)).all().item<bool>(),
                  "uneven split from " << s);
      off += rows(s, r);
    }
    // The list form.
    std::vector<at::Tensor> ins, outs;
    for (int d = 0; d < n; ++d) {
      ins.push_back(at::full({d + 1}, static_cast<int32_t>(r * 7 + d), at::kInt));
      outs.push_back(at::empty({r + 1}, at::kInt));
    }
    pg.all_to_all(outs, ins)->wait();
    for (int s = 0; s < n; ++s) {
      WORLD_CHECK(outs[s].eq(s * 7 + r).all().item<bool>(), "all_to_all list from " << s);
    }
}

inline void SendRecvWithTagsAndBarrier(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    if (n > 1) {
      // A ring: send to the next rank under two tags, receive them in the
      // opposite order from the previous one.
      const int next = (r + 1) % n, prev = (r + n - 1) % n;
      at::Tensor small = at::full({3}, static_cast<float>(r));
      at::Tensor big = at::arange(300'000, at::kFloat) + r;
      auto s1 = pg.send(small, next, /*tag=*/1);
      auto s2 = pg.send(big.slice(0, 0, 20'000).contiguous(), next, /*tag=*/2);
      at::Tensor got_big = at::empty({20'000}, at::kFloat), got_small = at::empty({3}, at::kFloat);
      pg.recv(got_big, prev, 2)->wait();
      pg.recv(got_small, prev, 1)->wait();
      s1->wait();
      s2->wait();
      EQUAL_OR_THROW(got_small, at::full({3}, static_cast<float>(prev)), "tagged recv");
      EQUAL_OR_THROW(got_big, (at::arange(300'000, at::kFloat) + prev).slice(0, 0, 20'000), "large tagged recv");
      // A message several times the size of a pair's ring streams through.
      if (r == 0) pg.send(big, 1, 3)->wait();
      if (r == 1) {
        at::Tensor got = at::empty({300'000}, at::kFloat);
        pg.recv(got, 0, 3)->wait();
        EQUAL_OR_THROW(got, at::arange(300'000, at::kFloat), "streamed recv");
      }
    }
    for (int i = 0; i < 20; ++i) pg.barrier()->wait();
}

inline void ManyQueuedOpsCompleteInOrder(ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    std::vector<at::Tensor> ts;
    std::vector<std::shared_ptr<tdist::Work>> works;
    for (int i = 0; i < 200; ++i) {
      ts.push_back(at::full({i % 17 + 1}, static_cast<float>(r + i)));
      works.push_back(pg.all_reduce(ts.back()));
    }
    for (int i = 0; i < 200; ++i) {
      works[i]->wait();
      const float want = static_cast<float>(n * (n - 1) / 2 + n * i);
      WORLD_CHECK(ts[i].eq(want).all().item<bool>(), "queued all_reduce " << i);
    }
    // Numbered in the order they ran, which is the order they were queued.
    for (int i = 0; i < 200; ++i) {
      WORLD_CHECK(works[i]->seq() == works[0]->seq() + static_cast<uint64_t>(i) && works[0]->seq() > 0,
                  "op " << i << " is #" << works[i]->seq() << ", the first #" << works[0]->seq());
    }
}

// The pieces, cut differently on every rank (even and odd ranks swap two
// layouts), come back equal to all_reduce of the whole.
// AllreduceOptions::wire_dtype: float32 carried as float16/bfloat16 gives
// exactly what casting a copy, all-reducing it and casting back gives, in
// one piece or cut differently on each rank, on every path of a backend
// (small, one round, many rounds). Values are chosen to round: ties, ones
// that overflow float16 and ones below its subnormals.
inline void AllReduceWireDtypeIsCastReduceCast(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  const std::vector<std::vector<std::vector<int64_t>>> layouts = {
      {{7}, {3, 4}},
      {{1, 0, 7, 1001}, {1009}},
      {{40'000, 1, 300'007, 0, 13}, {13, 300'007, 0, 40'000, 1}},
  };
  at::manual_seed(300 + r);  // the same values on every run: a rounding case found once is found again
  for (auto wire : {at::kHalf, at::kBFloat16}) {
    for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
      for (const auto& pair : layouts) {
        const auto& cuts = pair[r % 2];
        int64_t total = 0;
        for (int64_t c : cuts) total += c;
        at::Tensor whole = at::randn({total}, at::TensorOptions().dtype(at::kFloat)) * (r + 1);
        if (total > 8) {
          whole[0] = 1.0f + 1.0f / 2048;  // a tie in float16
          whole[1] = 70000.0f * (r + 1);  // beyond float16
          whole[2] = 1e-9f;               // below float16's subnormals
          whole[3] = 1.0f + 1.0f / 256;   // a tie in bfloat16
        }
        at::Tensor want = whole.to(wire);
        pg.all_reduce(want, {op})->wait();
        want = want.to(at::kFloat);

        std::vector<at::Tensor> pieces;
        int64_t at_ = 0;
        for (int64_t c : cuts) {
          pieces.push_back(whole.slice(0, at_, at_ + c).clone());
          at_ += c;
        }
        tdist::AllreduceOptions o;
        o.op = op;
        o.wire_dtype = wire;
        pg.all_reduce_coalesced(pieces, o)->wait();
        EQUAL_OR_THROW(at::cat(pieces), want,
                       "all_reduce_coalesced as " << name(wire) << " " << op_name(op) << " x " << total << " in "
                                                  << cuts.size() << " pieces");
        at::Tensor one = whole.clone();
        pg.all_reduce(one, o)->wait();
        EQUAL_OR_THROW(one, want, "all_reduce as " << name(wire) << " " << op_name(op) << " x " << total);
      }
    }
  }
  // Only float32 can be carried narrower; refused before anything is sent.
  for (auto [t, wire] : {std::pair{at::kDouble, at::kHalf}, std::pair{at::kFloat, at::kLong}}) {
    bool threw = false;
    try {
      tdist::AllreduceOptions o;
      o.wire_dtype = wire;
      pg.all_reduce(at::zeros({3}, t), o);
    } catch (const tdist::UsageError& e) {
      threw = std::string(e.what()).find("wire_dtype") != std::string::npos;
    }
    WORLD_CHECK(threw, "all_reduce accepted " << name(t) << " as " << name(wire));
  }
  // A wire type equal to the tensors' own is a plain all-reduce.
  at::Tensor h = at::ones({5}, at::kHalf);
  tdist::AllreduceOptions same;
  same.wire_dtype = at::kHalf;
  pg.all_reduce(h, same)->wait();
  EQUAL_OR_THROW(h, at::full({5}, n, at::kHalf), "half as half");
}

// empty_symmetric: zero-filled, symmetric where the backend has symmetric
// memory (shm), ordinary elsewhere; all_reduce on it gives what it gives on
// ordinary tensors (the same bits), through every path: the same part of
// one block on every rank (in place between the copies), cut differently
// per rank, narrowed on the wire, and ranks that disagree (staging).
inline void AllReduceOnSymmetricMemory(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  const int64_t cap = 300'011;
  WORLD_CHECK(pg.has_symmetric_memory() == (pg.backend_name() == "shm"), "has_symmetric_memory on " << pg.backend_name());
  for (auto t : {at::kFloat, at::kDouble, at::kHalf, at::kLong}) {
    at::Tensor block = pg.empty_symmetric({cap}, t);
    WORLD_CHECK(block.scalar_type() == t && block.numel() == cap && block.eq(0).all().item<bool>(),
                "empty_symmetric " << name(t) << " is not zero-filled");
    WORLD_CHECK(pg.is_symmetric(block) == pg.has_symmetric_memory(), "is_symmetric " << name(t));
    for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
      if (op == ReduceOp::AVG && !floating(t)) continue;
      for (int64_t size : {int64_t(0), int64_t(7), int64_t(40'000), int64_t(300'007)}) {
        for (int64_t offset : {int64_t(0), int64_t(3)}) {  // 3: not on a cache line
          at::Tensor x = block.slice(0, offset, offset + size);
          x.copy_(input_for(r, n, size, t, op));
          pg.all_reduce(x, {op})->wait();
          EQUAL_OR_THROW(x, expected_for(n, size, t, op),
                         "symmetric all_reduce " << name(t) << " " << op_name(op) << " x " << size << " at " << offset);
        }
      }
    }
  }
  // The same bits as on ordinary memory, for inputs that round.
  at::Tensor block = pg.empty_symmetric({cap});
  at::manual_seed(77 + r);
  const at::Tensor whole = at::randn({cap}) * (r + 1);
  {
    at::Tensor plain = whole.clone();
    pg.all_reduce(plain, {ReduceOp::AVG})->wait();
    block.copy_(whole);
    pg.all_reduce(block, {ReduceOp::AVG})->wait();
    EQUAL_OR_THROW(block, plain, "symmetric AVG of random floats");
  }
  // Pieces of the block, cut differently on even and odd ranks.
  const std::vector<std::vector<int64_t>> cuts = {{100'000, 0, 200'011}, {1, 150'000, 150'010}};
  {
    at::Tensor plain = whole.clone();
    pg.all_reduce(plain)->wait();
    block.copy_(whole);
    std::vector<at::Tensor> pieces;
    int64_t at_ = 0;
    for (int64_t c : cuts[r % 2]) {
      pieces.push_back(block.slice(0, at_, at_ + c));
      at_ += c;
    }
    pg.all_reduce_coalesced(pieces)->wait();
    EQUAL_OR_THROW(block, plain, "symmetric all_reduce_coalesced");
  }
  // Narrowed on the wire: the bits of cast, all-reduce, cast back.
  for (auto wire : {at::kHalf, at::kBFloat16}) {
    at::Tensor want = whole.to(wire);
    pg.all_reduce(want, {ReduceOp::AVG})->wait();
    block.copy_(whole);
    tdist::AllreduceOptions o;
    o.op = ReduceOp::AVG;
    o.wire_dtype = wire;
    pg.all_reduce(block, o)->wait();
    EQUAL_OR_THROW(block, want.to(at::kFloat), "symmetric all_reduce as " << name(wire));
  }
  // Ranks that disagree: rank 0 passes ordinary memory, or each rank a
  // different part of the block.
  const int64_t size = 200'000;
  const at::Tensor mine = input_for(r, n, size, at::kFloat, ReduceOp::SUM);
  const at::Tensor want = expected_for(n, size, at::kFloat, ReduceOp::SUM);
  for (int variant = 0; variant < 2; ++variant) {
    at::Tensor x = variant == 0 ? (r == 0 ? at::empty({size}) : block.slice(0, 0, size))
                                : block.slice(0, r * 1000, r * 1000 + size);
    x.copy_(mine);
    pg.all_reduce(x)->wait();
    EQUAL_OR_THROW(x, want, (variant == 0 ? "rank 0 without symmetric memory" : "different parts per rank"));
    // ... and the next op is in step.
    at::Tensor one = block.slice(0, 0, 1000).fill_(1);
    pg.all_reduce(one)->wait();
    EQUAL_OR_THROW(one, at::full({1000}, static_cast<float>(n)), "all_reduce after a disagreement");
  }
  // A block outlives its group, and is freed after it.
  auto sub = pg.new_group([&] {
    std::vector<int> all(n);
    for (int k = 0; k < n; ++k) all[k] = k;
    return all;
  }());
  at::Tensor kept = sub->empty_symmetric({1000}, at::kFloat);
  kept.fill_(r);
  sub->all_reduce(kept)->wait();
  sub.reset();
  EQUAL_OR_THROW(kept, at::full({1000}, n * (n - 1) / 2.0f), "symmetric tensor after its group is gone");
  kept = at::Tensor();
}

inline void AllReduceCoalescedMatchesTheConcatenation(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  const std::vector<std::vector<std::vector<int64_t>>> layouts = {
      {{5}, {2, 0, 3}},
      {{1, 0, 7, 1001}, {1009}},
      {{40'000, 1, 300'007, 0, 13}, {13, 300'007, 0, 40'000, 1}},  // crosses the multi-round chunks
      {std::vector<int64_t>(64, 4'999), {4'999 * 63, 4'999}},
  };
  for (auto t : {at::kFloat, at::kHalf, at::kBFloat16, at::kLong}) {
    for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
      if (op == ReduceOp::AVG && !floating(t)) continue;
      for (const auto& pair : layouts) {
        const auto& cuts = pair[r % 2];
        int64_t total = 0;
        for (int64_t c : cuts) total += c;
        const at::Tensor whole = input_for(r, n, total, t, op);
        std::vector<at::Tensor> pieces;
        int64_t at_ = 0;
        for (int64_t c : cuts) {
          pieces.push_back(whole.slice(0, at_, at_ + c).clone());
          at_ += c;
        }
        pg.all_reduce_coalesced(pieces, {op})->wait();
        EQUAL_OR_THROW(at::cat(pieces), expected_for(n, total, t, op),
                       "all_reduce_coalesced " << name(t) << " " << op_name(op) << " x " << total << " in "
                                               << cuts.size() << " pieces");
      }
    }
  }
  // Misuse is refused before anything is sent.
  bool threw = false;
  try {
    pg.all_reduce_coalesced({at::zeros({3}), at::zeros({3}, at::kDouble)});
  } catch (const tdist::UsageError& e) {
    threw = std::string(e.what()).find("different dtypes") != std::string::npos;
  }
  WORLD_CHECK(threw, "all_reduce_coalesced accepted mixed dtypes");
  threw = false;
  try {
    pg.all_reduce_coalesced({});
  } catch (const tdist::UsageError&) {
    threw = true;
  }
  WORLD_CHECK(threw, "all_reduce_coalesced accepted an empty list");
  // The group is still in step afterwards.
  at::Tensor one = at::ones({2});
  pg.all_reduce(one)->wait();
  EQUAL_OR_THROW(one, at::full({2}, static_cast<double>(n)), "all_reduce after refused calls");
}

// Threads that wait run the op they wait for themselves when it is next
// (Work::wait): with several waiting threads, the worker and chains that
// queue more collectives from callbacks, ops still run once each, in queue
// order, and every chained collective right after the op it follows.
inline void WaitersOnSeveralThreadsKeepTheOrder(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  constexpr int kOps = 120;
  std::vector<at::Tensor> ts, chained(kOps);
  std::vector<std::shared_ptr<tdist::Work>> works, chains(kOps);
  for (int i = 0; i < kOps; ++i) {
    ts.push_back(at::full({i % 13 + 1}, static_cast<float>(r + i)));
    works.push_back(pg.all_reduce(ts.back()));
    if (i % 10 == 0) {
      chained[i] = at::full({3}, static_cast<float>(r));
      chains[i] = works.back()->chain([&pg, &chained, i](tdist::Work&) { return pg.all_reduce(chained[i]); });
    }
  }
  std::vector<std::thread> waiters;
  std::atomic<int> failures{0};
  for (int k = 0; k < 4; ++k) {
    waiters.emplace_back([&, k] {
      try {
        // Thread 0 waits front to back, the others back to front.
        for (int j = 0; j < kOps; ++j) {
          const int i = k == 0 ? j : kOps - 1 - j;
          if (i % 4 == k || k == 0) works[i]->wait();
        }
      } catch (...) {
        failures.fetch_add(1);
      }
    });
  }
  for (auto& t : waiters) t.join();
  WORLD_CHECK(failures.load() == 0, "a wait threw");
  for (int i = 0; i < kOps; ++i) {
    const float want = static_cast<float>(n * (n - 1) / 2 + n * i);
    WORLD_CHECK(ts[i].eq(want).all().item<bool>(), "all_reduce " << i);
    if (chains[i]) {
      chains[i]->wait();
      WORLD_CHECK(chained[i].eq(static_cast<float>(n * (n - 1) / 2)).all().item<bool>(), "chained all_reduce " << i);
    }
  }
}

// all_gather_into_tensor and reduce_scatter_tensor whose inputs lie in
// symmetric memory (read straight from the ranks' copies on shm) give what
// they give on ordinary memory; so do an input that is the output's own
// slot, and ranks that disagree (rank 0 ordinary: everyone stages).
inline void GatherAndReduceScatterOnSymmetricMemory(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  for (int64_t count : {int64_t(0), int64_t(5), int64_t(70'001), int64_t(600'000)}) {
    at::Tensor block = pg.empty_symmetric({n * count + 3});
    at::manual_seed(500 + r);
    const at::Tensor mine = at::randn({count});
    const at::Tensor all = at::randn({n * count}) * (r + 1);
    at::Tensor want_gather = at::empty({n * count});
    pg.all_gather_into_tensor(want_gather, mine)->wait();
    at::Tensor want_scatter = at::empty({count});
    pg.reduce_scatter_tensor(want_scatter, all, {ReduceOp::AVG})->wait();
    for (int64_t offset : {int64_t(0), int64_t(3)}) {
      at::Tensor in = block.slice(0, offset, offset + count);
      in.copy_(mine);
      at::Tensor out = at::empty({n * count});
      pg.all_gather_into_tensor(out, in)->wait();
      EQUAL_OR_THROW(out, want_gather, "symmetric all_gather x " << count << " at " << offset);
      at::Tensor big = block.slice(0, offset, offset + n * count);
      big.copy_(all);
      at::Tensor got = at::empty({count});
      pg.reduce_scatter_tensor(got, big, {ReduceOp::AVG})->wait();
      EQUAL_OR_THROW(got, want_scatter, "symmetric reduce_scatter x " << count << " at " << offset);
    }
    // The input is this rank's slot of a symmetric output.
    at::Tensor out = block.slice(0, 0, n * count);
    out.slice(0, r * count, (r + 1) * count).copy_(mine);
    pg.all_gather_into_tensor(out, out.slice(0, r * count, (r + 1) * count))->wait();
    EQUAL_OR_THROW(out, want_gather, "symmetric in-place all_gather x " << count);
    // Rank 0 passes ordinary memory: everyone takes the staging path.
    at::Tensor in = r == 0 ? mine.clone() : block.slice(0, 0, count);
    if (r != 0) in.copy_(mine);
    at::Tensor mixed = at::empty({n * count});
    pg.all_gather_into_tensor(mixed, in)->wait();
    EQUAL_OR_THROW(mixed, want_gather, "mixed all_gather x " << count);
  }
}

// async_op=false: every op has run when the call returns (its Work is
// completed, with the result of the queued form), whether the group was
// idle (the op runs on the calling thread) or still busy with ops queued
// before it (it waits its turn behind them).
inline void SynchronousCallsAreDoneOnReturn(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  tdist::AllreduceOptions ar;
  ar.async_op = false;
  tdist::CollectiveOptions co;
  co.async_op = false;
  for (int64_t size : {int64_t(0), int64_t(1), int64_t(1001), int64_t(300'007)}) {
    const auto f = at::kFloat;
    at::Tensor x = input(r, size, f, ReduceOp::SUM);
    auto w = pg.all_reduce(x, ar);
    WORLD_CHECK(w->is_success(), "all_reduce x " << size << " returned undone");
    WORLD_CHECK(w->result().size() == 1 && w->result()[0].is_same(x), "all_reduce's result");
    EQUAL_OR_THROW(x, expected(n, size, f, ReduceOp::SUM), "synchronous all_reduce x " << size);

    tdist::BroadcastOptions bo;
    bo.root = n - 1;
    bo.async_op = false;
    at::Tensor b = input(r, size, f, ReduceOp::SUM);
    WORLD_CHECK(pg.broadcast(b, bo)->is_success(), "broadcast returned undone");
    EQUAL_OR_THROW(b, input(n - 1, size, f, ReduceOp::SUM), "synchronous broadcast x " << size);

    tdist::ReduceOptions ro;
    ro.async_op = false;
    at::Tensor y = input(r, size, f, ReduceOp::SUM);
    WORLD_CHECK(pg.reduce(y, ro)->is_success(), "reduce returned undone");
    if (r == 0) EQUAL_OR_THROW(y, expected(n, size, f, ReduceOp::SUM), "synchronous reduce x " << size);

    at::Tensor flat = at::empty({size * n});
    WORLD_CHECK(pg.all_gather_into_tensor(flat, input(r, size, f, ReduceOp::SUM), co)->is_success(),
                "all_gather returned undone");
    for (int q = 0; q < n; ++q) {
      EQUAL_OR_THROW(flat.slice(0, q * size, (q + 1) * size), input(q, size, f, ReduceOp::SUM),
                     "synchronous all_gather x " << size << ", from rank " << q);
    }

    tdist::ReduceScatterOptions rso;
    rso.async_op = false;
    at::Tensor all = input(r, size * n, f, ReduceOp::SUM);
    at::Tensor part = at::empty({size});
    WORLD_CHECK(pg.reduce_scatter_tensor(part, all, rso)->is_success(), "reduce_scatter returned undone");
    EQUAL_OR_THROW(part, expected(n, size * n, f, ReduceOp::SUM).slice(0, r * size, (r + 1) * size),
                   "synchronous reduce_scatter x " << size);
    WORLD_CHECK(pg.barrier(co)->is_success(), "barrier returned undone");
  }
  // Behind queued ops: they have all run, in order, when it returns.
  std::vector<at::Tensor> ts;
  std::vector<std::shared_ptr<tdist::Work>> queued;
  for (int i = 0; i < 20; ++i) {
    ts.push_back(at::full({40'000}, static_cast<float>(r + i)));
    queued.push_back(pg.all_reduce(ts.back()));
  }
  at::Tensor last = at::full({3}, static_cast<float>(r));
  WORLD_CHECK(pg.all_reduce(last, ar)->is_success(), "the all_reduce behind queued ones returned undone");
  EQUAL_OR_THROW(last, at::full({3}, static_cast<float>(n * (n - 1) / 2)), "the all_reduce behind queued ones");
  for (int i = 0; i < 20; ++i) {
    WORLD_CHECK(queued[i]->is_completed(), "queued all_reduce " << i << " had not run before the synchronous one");
    WORLD_CHECK(queued[i]->seq() < queued.back()->seq() + 1, "sequence numbers");
    WORLD_CHECK(ts[i].eq(static_cast<float>(n * (n - 1) / 2 + n * i)).all().item<bool>(), "queued all_reduce " << i);
  }
}

inline const std::vector<std::pair<const char*, void (*)(ProcessGroup&)>>& all_cases() {
  static const std::vector<std::pair<const char*, void (*)(ProcessGroup&)>> cases = {
      {"AllReduceEveryDtypeOpAndSize", AllReduceEveryDtypeOpAndSize},
      {"AllReduceCoalescedMatchesTheConcatenation", AllReduceCoalescedMatchesTheConcatenation},
      {"AllReduceWireDtypeIsCastReduceCast", AllReduceWireDtypeIsCastReduceCast},
      {"AllReduceOnSymmetricMemory", AllReduceOnSymmetricMemory},
      {"ReduceToEveryRoot", ReduceToEveryRoot},
      {"BroadcastFromEveryRoot", BroadcastFromEveryRoot},
      {"AllGatherBothForms", AllGatherBothForms},
      {"ReduceScatterBothForms", ReduceScatterBothForms},
      {"AllGatherCoalescedMatchesEachAllGather", AllGatherCoalescedMatchesEachAllGather},
      {"ReduceScatterCoalescedMatchesEachReduceScatter", ReduceScatterCoalescedMatchesEachReduceScatter},
      {"GatherAndReduceScatterOnSymmetricMemory", GatherAndReduceScatterOnSymmetricMemory},
      {"GatherAndScatterAtEveryRoot", GatherAndScatterAtEveryRoot},
      {"AllToAllEqualAndUnevenSplits", AllToAllEqualAndUnevenSplits},
      {"SendRecvWithTagsAndBarrier", SendRecvWithTagsAndBarrier},
      {"ManyQueuedOpsCompleteInOrder", ManyQueuedOpsCompleteInOrder},
      {"WaitersOnSeveralThreadsKeepTheOrder", WaitersOnSeveralThreadsKeepTheOrder},
      {"SynchronousCallsAreDoneOnReturn", SynchronousCallsAreDoneOnReturn},
  };
  return cases;
}

}  // namespace tdist::test::conformance
