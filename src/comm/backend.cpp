// What every backend shares: the piece walker and the packing fallback of
// all_reduce_coalesced.
#include "comm/backend.h"

#include <vector>

#include "comm/reduce.h"

namespace tdist::comm {

PieceWalker::PieceWalker(const std::vector<Piece>& pieces, size_t element_size)
    : pieces_(pieces), es_(element_size) {
  starts_.reserve(pieces.size() + 1);
  size_t total = 0;
  for (const Piece& p : pieces) {
    starts_.push_back(total);
    total += p.count;
  }
  starts_.push_back(total);
}

size_t PieceWalker::locate(size_t element) const {
  // The last piece starting at or before element (skips empty pieces).
  auto it = std::upper_bound(starts_.begin(), starts_.end() - 1, element);
  return static_cast<size_t>(it - starts_.begin()) - 1;
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
}

}  // namespace tdist::comm
