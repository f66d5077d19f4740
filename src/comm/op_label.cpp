// The thread's running op number and its lazy deadline; the contracts are
// in op_label.h and backend.h (LazyDeadlineScope).
#include "comm/op_label.h"

#include "comm/backend.h"

namespace tdist::comm {
namespace {
thread_local uint64_t t_label = 0;
thread_local LazyDeadlineScope* t_deadline = nullptr;
}  // namespace

uint64_t current_op_label() { return t_label; }

OpLabelScope::OpLabelScope(uint64_t label) : saved_(t_label) { t_label = label; }
OpLabelScope::~OpLabelScope() { t_label = saved_; }

LazyDeadlineScope::LazyDeadlineScope(std::chrono::milliseconds timeout) : timeout_(timeout), saved_(t_deadline) {
  t_deadline = this;
}
LazyDeadlineScope::~LazyDeadlineScope() { t_deadline = saved_; }

Deadline LazyDeadlineScope::resolve() {
  if (!resolved_) {
    at_ = Clock::now() + timeout_;
    resolved_ = true;
  }
  return at_;
}

Deadline resolve_deadline(Deadline d) {
  if (d != kLazyDeadline || t_deadline == nullptr) return d;
  return t_deadline->resolve();
}

}  // namespace tdist::comm
