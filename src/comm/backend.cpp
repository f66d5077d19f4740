// What every backend shares: the piece walker and the packing fallbacks of
// the coalesced ops.
#include "comm/backend.h"

#include <cstring>
#include <string>
#include <vector>

#include "comm/reduce.h"
#include "tdist/errors.h"

namespace tdist::comm {

PieceWalker::PieceWalker(const Piece* pieces, size_t n, size_t element_size)
    : pieces_(pieces), n_(n), es_(element_size), inline_{} {
  if (n <= kInline) {
    starts_ = inline_;
  } else {
    heap_.resize(n + 1);
    starts_ = heap_.data();
  }
  size_t total = 0;
  for (size_t k = 0; k < n; ++k) {
    starts_[k] = total;
    total += pieces[k].count;
  }
  starts_[n] = total;
}

size_t PieceWalker::locate(size_t element) const {
  // The last piece starting at or before element (skips empty pieces).
  const size_t* it = std::upper_bound(starts_, starts_ + n_, element);
  return static_cast<size_t>(it - starts_) - 1;
}

void Backend::all_reduce_coalesced(const std::vector<Piece>& pieces, DataType t, ReduceOp op, Deadline d) {
  if (pieces.size() == 1) {
    all_reduce(pieces[0].data, pieces[0].count, t, op, d);
    return;
  }
  packed_all_reduce(pieces, t, t, op, d);
}

void Backend::all_reduce_coalesced_as(const std::vector<Piece>& pieces, DataType t, DataType wire, ReduceOp op,
                                      Deadline d) {
  if (wire == t) {
    all_reduce_coalesced(pieces, t, op, d);
    return;
  }
  packed_all_reduce(pieces, t, wire, op, d);
}

namespace {

// The packed buffer is kept between calls up to this size; a larger one
// (a big FSDP unit on gloo) is given back after its call, so that no
// backend holds a model-sized buffer for good.
constexpr size_t kKeptPackBytes = size_t{64} << 20;

void trim(std::vector<uint8_t>& pack) {
  if (pack.capacity() > kKeptPackBytes) std::vector<uint8_t>().swap(pack);
}

// UsageError unless in and out pair up as `op` needs: out[k] holds
// `ratio` times in[k] (all_gather), or in[k] holds it times out[k]
// (reduce_scatter). Returns the total elements of the smaller side.
size_t check_pairs(const char* op, const std::vector<Piece>& in, const std::vector<Piece>& out, int ratio,
                   bool out_is_larger) {
  if (in.size() != out.size()) {
    throw UsageError(std::string(op) + ": " + std::to_string(in.size()) + " inputs but " +
                     std::to_string(out.size()) + " outputs");
  }
  size_t total = 0;
  for (size_t k = 0; k < in.size(); ++k) {
    const size_t small = out_is_larger ? in[k].count : out[k].count;
    const size_t large = out_is_larger ? out[k].count : in[k].count;
    if (large != small * static_cast<size_t>(ratio)) {
      throw UsageError(std::string(op) + ": piece " + std::to_string(k) + " has " + std::to_string(in[k].count) +
                       " input and " + std::to_string(out[k].count) + " output elements; a group of " +
                       std::to_string(ratio) + " needs the " + (out_is_larger ? "output" : "input") + " " +
                       std::to_string(ratio) + " times the " + (out_is_larger ? "input" : "output"));
    }
    total += small;
  }
  return total;
}

}  // namespace

void Backend::all_gather_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                                   Deadline d) {
  const size_t total = check_pairs("all_gather_coalesced", in, out, size(), /*out_is_larger=*/true);
  const size_t es = dtype_size(t);
  const size_t n = static_cast<size_t>(size());
  if (in.size() == 1) {
    all_gather(in[0].data, out[0].data, in[0].count * es, d);
    return;
  }
  // [rank 0's pieces][rank 1's]...: this rank's packed in place of its own
  // slot (all_gather lets in alias it).
  pack_.resize(total * es * n);
  uint8_t* mine = pack_.data() + static_cast<size_t>(rank()) * total * es;
  size_t off = 0;
  for (const Piece& p : in) {
    if (p.count > 0) std::memcpy(mine + off, p.data, p.count * es);
    off += p.count * es;
  }
  all_gather(mine, pack_.data(), total * es, d);
  for (size_t r = 0; r < n; ++r) {
    off = r * total * es;
    for (size_t k = 0; k < in.size(); ++k) {
      const size_t bytes = in[k].count * es;
      if (bytes > 0) std::memcpy(static_cast<uint8_t*>(out[k].data) + r * bytes, pack_.data() + off, bytes);
      off += bytes;
    }
  }
  trim(pack_);
}

void Backend::reduce_scatter_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                                       ReduceOp op, Deadline d) {
  const size_t total = check_pairs("reduce_scatter_coalesced", in, out, size(), /*out_is_larger=*/false);
  check_reduction(t, op);
  const size_t es = dtype_size(t);
  const size_t n = static_cast<size_t>(size());
  if (in.size() == 1) {
    reduce_scatter(in[0].data, out[0].data, out[0].count, t, op, d);
    return;
  }
  // Rank r's slices of every piece back to back, rank by rank; the result
  // lands after them.
  pack_.resize(total * es * (n + 1));
  uint8_t* result = pack_.data() + total * es * n;
  size_t off = 0;
  for (size_t r = 0; r < n; ++r) {
    for (size_t k = 0; k < in.size(); ++k) {
      const size_t bytes = out[k].count * es;
      if (bytes > 0) std::memcpy(pack_.data() + off, static_cast<const uint8_t*>(in[k].data) + r * bytes, bytes);
      off += bytes;
    }
  }
  reduce_scatter(pack_.data(), result, total, t, op, d);
  off = 0;
  for (const Piece& p : out) {
    if (p.count > 0) std::memcpy(p.data, result + off, p.count * es);
    off += p.count * es;
  }
  trim(pack_);
}

std::shared_ptr<void> Backend::allocate_symmetric(size_t, Deadline, std::string* why_not) {
  if (why_not) *why_not = "the " + name() + " backend has no symmetric memory";
  return nullptr;
}

bool Backend::is_symmetric(const void*, size_t) const { return false; }

void Backend::packed_all_reduce(const std::vector<Piece>& pieces, DataType t, DataType wire, ReduceOp op,
                                Deadline d) {
  const size_t es = dtype_size(t), ws = dtype_size(wire);
  PieceWalker walk(pieces, es);
  pack_.resize(walk.count() * ws);
  walk.for_each(0, walk.count(), [&](uint8_t* p, size_t off, size_t n) {
    convert(pack_.data() + off * ws, wire, p, t, n);
  });
  all_reduce(pack_.data(), walk.count(), wire, op, d);
  walk.for_each(0, walk.count(), [&](uint8_t* p, size_t off, size_t n) {
    convert(p, t, pack_.data() + off * ws, wire, n);
  });
  trim(pack_);
}

}  // namespace tdist::comm
