// agree_on_path: the contract is in path.h.
#include "comm/shm/path.h"

namespace tdist::comm::shm {

Path agree_on_path(Rounds& rounds, const PathOffer& offer, const OpDesc& desc, Deadline d,
                   const std::function<void()>& post_round0) {
  const uint64_t none[2] = {0, 0};
  const uint64_t* key = offer.sym_key ? offer.sym_key : none;
  const bool have_key = (key[0] | key[1]) != 0;
  const bool cma_offer = offer.cma && offer.cma_offer;
  uint64_t* published = rounds.sym_key_slot();
  published[0] = key[0];
  published[1] = key[1];
  if (offer.cma) offer.cma->publish(rounds, cma_offer, offer.in, offer.out);
  else *rounds.cma_slot() = CmaOffer{};
  if (!have_key && !cma_offer) post_round0();
  rounds.first_barrier(desc, d);
  bool all_same = have_key, any_key = false;
  for (int r = 0; r < rounds.size(); ++r) {
    const uint64_t* k = rounds.sym_key_of(r);
    any_key = any_key || (k[0] | k[1]) != 0;
    all_same = all_same && k[0] == key[0] && k[1] == key[1];
  }
  if (all_same) return Path::kSymmetric;
  int offers = 0;
  for (int r = 0; r < rounds.size(); ++r) offers += rounds.cma_of(r).offered == 1;
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

}  // namespace tdist::comm::shm
