// Crossover and CrossoverTrial: the contract is in crossover.h.
#include "comm/shm/crossover.h"

#include <exception>

namespace tdist::comm::shm {

namespace {

int bucket_index(size_t bytes) {
  int b = 0;
  while (bytes > 1 && b < 63) {
    bytes >>= 1;
    ++b;
  }
  return b;
}

// An op's place in a timing block (ops s to s+3 of a bucket, from s = 2,
// 6, then 16, 32, 64, ...), or -1 outside one.
int block_place(uint64_t n) {
  if (n >= 2 && n < 10) return static_cast<int>((n - 2) % 4);
  if (n < 16) return -1;
  const uint64_t start = uint64_t(1) << (63 - __builtin_clzll(n));
  return n - start < 4 ? static_cast<int>(n - start) : -1;
}

}  // namespace

Crossover::Bucket& Crossover::bucket(Op op, size_t bytes) {
  return buckets_[static_cast<size_t>(op)][bucket_index(bytes)];
}

const Crossover::Bucket& Crossover::bucket(Op op, size_t bytes) const {
  return buckets_[static_cast<size_t>(op)][bucket_index(bytes)];
}

Crossover::Plan Crossover::next(Op op, size_t bytes) {
  Bucket& b = bucket(op, bytes);
  const int place = block_place(b.ops++);
  if (place < 0) return {decides_ ? b.single_copy : b.leader_single_copy, false, false};
  // A block: staged twice, then single-copy twice, each path's second op
  // timed (the first may still pay the other path's tail: a staged op's
  // last rank copying out after the final barrier).
  return {place >= 2, decides_ && place % 2 == 1, true};
}

void Crossover::record(Op op, size_t bytes, bool single_copy, double seconds) {
  Bucket& b = bucket(op, bytes);
  double& best = b.best[single_copy ? 1 : 0];
  if (best < 0 || seconds < best) best = seconds;
  // A path never timed is not chosen (a group whose peers did not all
  // offer never went single-copy).
  const double staged = b.best[0], single = b.best[1];
  if (staged >= 0 && single >= 0) {
    b.single_copy = single < staged;
  } else if (staged >= 0) {
    b.single_copy = false;
  }
}

CrossoverTrial::CrossoverTrial(Crossover* c, Crossover::Op op, size_t bytes, bool may_offer, bool eligible)
    : op_(op), bytes_(bytes), offers_(may_offer && eligible) {
  if (!may_offer || !c) return;
  const Crossover::Plan p = c->next(op, bytes);
  crossover_ = c;
  offers_ = p.single_copy && eligible;
  in_block_ = p.in_block;
  if (!p.timed || !eligible) return;
  timed_ = true;
  exceptions_ = std::uncaught_exceptions();
  start_ = std::chrono::steady_clock::now();
}

void CrossoverTrial::agreed(bool symmetric, bool single_copy, bool leader_offered, bool leader_timed) {
  single_copy_ = single_copy;
  if (symmetric) timed_ = false;
  closing_barrier_ = leader_timed && !symmetric && !single_copy;
  if (crossover_ && !in_block_) crossover_->follow(op_, bytes_, leader_offered);
}

CrossoverTrial::~CrossoverTrial() {
  if (!timed_ || std::uncaught_exceptions() != exceptions_) return;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  crossover_->record(op_, bytes_, single_copy_, s);
}

}  // namespace tdist::comm::shm
