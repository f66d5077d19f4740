// agree_on_path: the contract is in path.h.
#include "comm/shm/path.h"

namespace tdist::comm::shm {

namespace {
// An op's first descriptor says what else a rank published with it, so
// that the others read a key or an offer only where there is one: a small
// op's whole first round stays in one cache line (rounds.h).
constexpr uint8_t kHasKey = 1;      // its symmetric key is in sym_key
constexpr uint8_t kOffersCma = 2;   // its single-copy offer is in cma
constexpr uint8_t kTimed = 4;       // rank 0 times the op (crossover.h)

struct Leader {
  bool offered = false;  // rank 0 offered single-copy
  bool timed = false;    // rank 0 times the op
};

// The path; *leader: what rank 0 published with the op.
Path agree(Rounds& rounds, const PathOffer& offer, const OpDesc& desc, Deadline d,
           const std::function<void()>& post_round0, Leader* leader) {
  const uint64_t none[2] = {0, 0};
  const uint64_t* key = offer.sym_key ? offer.sym_key : none;
  const bool have_key = (key[0] | key[1]) != 0;
  const bool cma_offer = offer.cma && offer.cma_offer;
  OpDesc published = desc;
  published.flags = (have_key ? kHasKey : 0) | (cma_offer ? kOffersCma : 0) |
                    (offer.trial && offer.trial->timed() ? kTimed : 0);
  if (have_key) {
    uint64_t* slot = rounds.sym_key_slot();
    slot[0] = key[0];
    slot[1] = key[1];
  }
  if (cma_offer) offer.cma->publish(rounds, offer.in, offer.out);
  if (!have_key && !cma_offer) post_round0();
  rounds.first_barrier(published, d);
  const uint8_t leader_flags = rounds.desc_of(0).flags;
  leader->offered = (leader_flags & kOffersCma) != 0;
  leader->timed = (leader_flags & kTimed) != 0;
  bool all_same = have_key, any_key = false;
  int offers = 0;
  for (int r = 0; r < rounds.size(); ++r) {
    const uint8_t flags = rounds.desc_of(r).flags;
    if (flags & kHasKey) {
      const uint64_t* k = rounds.sym_key_of(r);
      any_key = true;
      all_same = all_same && k[0] == key[0] && k[1] == key[1];
    } else {
      all_same = false;
    }
    offers += (flags & kOffersCma) != 0;
  }
  if (all_same) return Path::kSymmetric;
  // Every rank offering includes this one, so offer.cma is set.
  if (offers == rounds.size()) {
    offer.cma->take_offers(rounds);
    if (offer.cma->confirm(rounds, desc, d)) return Path::kSingleCopy;
  }
  if (any_key || offers > 0) {
    // Some rank skipped round 0: everyone posts it (again, into this
    // round's buffer) and passes one more barrier.
    post_round0();
    rounds.barrier_round(desc, d);
  }
  return Path::kStaged;
}

}  // namespace

Path agree_on_path(Rounds& rounds, const PathOffer& offer, const OpDesc& desc, Deadline d,
                   const std::function<void()>& post_round0) {
  Leader leader;
  const Path path = agree(rounds, offer, desc, d, post_round0, &leader);
  if (offer.trial) {
    offer.trial->agreed(path == Path::kSymmetric, path == Path::kSingleCopy, leader.offered, leader.timed);
  }
  return path;
}

}  // namespace tdist::comm::shm
