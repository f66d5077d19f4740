// Join: the notification round and the joined rank's loop. The contract is
// in include/tdist/join.h.
//
// One round is one all_reduce (SUM) of world + 1 int32s over the first
// joinable's group: element r is 1 when rank r still trains, the last
// element counts the joined ranks that ask everyone to stop
// (throw_on_early_termination). A rank that trains contributes its round
// from notify_join_context; a joined rank from join()'s loop, once per
// iteration of the others, so the rounds pair up one to one.
//
// Owns (JoinState): the options, the group and device, and whether this
// rank has joined. Threading: the training thread. Lifetime: the Join
// owns it; each joinable points to it while the Join holds the joinable.
#include "tdist/join.h"

#include <ATen/ATen.h>

#include <exception>
#include <string>

namespace tdist {

namespace detail {

struct JoinState {
  JoinOptions options;
  std::shared_ptr<ProcessGroup> pg;
  c10::Device device{c10::kCPU};
  Joinable* first = nullptr;
  bool joined = false;  // this rank ran out; join() runs the hooks
  // An EarlyTerminationError was raised here: the Join is over for this
  // rank (join() does nothing more, even when the error was caught inside
  // the Join's scope).
  bool terminated = false;
};

namespace {

struct Round {
  int training = 0;        // ranks that still train
  int lowest_joined = -1;  // the lowest joined rank, as a global rank; -1: none has joined
  bool stop = false;       // some joined rank asks everyone to stop
};

Round run_round(JoinState& s, bool training) {
  const int world = s.pg->size();
  at::Tensor flags = at::zeros({world + 1}, at::kInt);
  if (training) flags[s.pg->rank()] = 1;
  if (!training && s.options.throw_on_early_termination) flags[world] = 1;
  at::Tensor on_device = s.device.is_cpu() ? flags : flags.to(s.device);
  AllreduceOptions o;
  o.op = ReduceOp::SUM;
  o.async_op = false;
  s.pg->all_reduce(on_device, o)->wait();
  const at::Tensor got = on_device.device().is_cpu() ? on_device : on_device.cpu();
  const int32_t* f = got.data_ptr<int32_t>();
  Round r;
  for (int k = 0; k < world; ++k) {
    if (f[k] != 0 && f[k] != 1) {
      throw CollectiveMismatchError("Join: rank " + std::to_string(s.pg->rank()) +
                                    " received a notification round that no Join made (element " + std::to_string(k) +
                                    " is " + std::to_string(f[k]) +
                                    "): the ranks' collectives are out of step, e.g. a rank left its loop without "
                                    "joining");
    }
    r.training += f[k];
    if (f[k] == 0 && r.lowest_joined < 0) r.lowest_joined = s.pg->ranks()[k];
  }
  r.stop = f[world] > 0;
  return r;
}

}  // namespace

}  // namespace detail

Joinable::~Joinable() = default;

const JoinOptions* Joinable::active_join() const {
  if (!join_state_ || join_state_->joined || join_state_->terminated || !join_state_->options.enable) return nullptr;
  return &join_state_->options;
}

bool Joinable::join_shadowing() const { return join_state_ && join_state_->joined; }

Join::Join(std::vector<Joinable*> joinables, JoinOptions options)
    : state_(std::make_unique<detail::JoinState>()),
      joinables_(std::move(joinables)),
      uncaught_at_start_(std::uncaught_exceptions()) {
  if (joinables_.empty()) throw UsageError("Join: give at least one joinable");
  for (size_t k = 0; k < joinables_.size(); ++k) {
    Joinable* j = joinables_[k];
    if (!j) throw UsageError("Join: joinable " + std::to_string(k) + " is null");
    if (j->join_state_) throw UsageError("Join: joinable " + std::to_string(k) + " is already held by another Join");
    for (size_t m = 0; m < k; ++m) {
      if (joinables_[m] == j) throw UsageError("Join: joinable " + std::to_string(k) + " is given twice");
    }
  }
  state_->options = options;
  state_->pg = joinables_[0]->join_process_group();
  if (!state_->pg) throw UsageError("Join: the first joinable has no process group");
  state_->device = joinables_[0]->join_device();
  state_->first = joinables_[0];
  for (size_t k = 1; k < joinables_.size(); ++k) {
    if (joinables_[k]->join_process_group().get() != state_->pg.get()) {
      throw UsageError("Join: joinable " + std::to_string(k) +
                       " works over another process group than the first; one Join serves one group");
    }
  }
  if (!options.enable) {
    done_ = true;
    return;
  }
  for (Joinable* j : joinables_) hooks_.push_back(j->join_hook(state_->options));
  for (Joinable* j : joinables_) j->join_state_ = state_.get();
}

Join::~Join() noexcept(false) {
  if (!done_ && std::uncaught_exceptions() == uncaught_at_start_) {
    join();
    return;
  }
  release();
}

void Join::release() noexcept {
  for (Joinable* j : joinables_) {
    if (j && j->join_state_ == state_.get()) j->join_state_ = nullptr;
  }
}

void Join::join() {
  detail::JoinState& s = *state_;
  if (done_ || s.terminated) {
    done_ = true;
    release();
    return;
  }
  done_ = true;
  s.joined = true;
  try {
    bool last = true;
    for (;;) {
      const detail::Round r = detail::run_round(s, /*training=*/false);
      if (r.training == 0) break;
      if (s.options.throw_on_early_termination) {
        s.terminated = true;
        throw EarlyTerminationError("Join: rank " + std::to_string(s.pg->ranks()[s.pg->rank()]) + " ran out of inputs while " +
                                        std::to_string(r.training) +
                                        " rank(s) still trained (throw_on_early_termination)",
                                    r.lowest_joined);
      }
      for (auto& h : hooks_) h->main_hook();
      last = false;
    }
    for (auto& h : hooks_) h->post_hook(last);
  } catch (...) {
    release();
    throw;
  }
  release();
}

void Join::notify_join_context(Joinable& joinable) {
  detail::JoinState* s = joinable.join_state_;
  if (!s || s->joined || s->terminated || !s->options.enable || s->first != &joinable) return;
  const detail::Round r = detail::run_round(*s, /*training=*/true);
  if (r.stop) {
    s->terminated = true;
    throw EarlyTerminationError("Join: rank " + std::to_string(r.lowest_joined) +
                                    " ran out of inputs before rank " + std::to_string(s->pg->ranks()[s->pg->rank()]) +
                                    " (throw_on_early_termination); every rank stops",
                                r.lowest_joined);
  }
}

}  // namespace tdist
