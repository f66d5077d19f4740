// The thread's running op number; the contract is in op_label.h.
#include "comm/op_label.h"

namespace tdist::comm {
namespace {
thread_local uint64_t t_label = 0;
}  // namespace

uint64_t current_op_label() { return t_label; }

OpLabelScope::OpLabelScope(uint64_t label) : saved_(t_label) { t_label = label; }
OpLabelScope::~OpLabelScope() { t_label = saved_; }

}  // namespace tdist::comm
