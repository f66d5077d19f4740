// CmaChannel: offers, the one-time probe, and the transfers. The contract
// is in cma.h.
#include "comm/shm/cma.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "comm/shm/waiter.h"

namespace tdist::comm::shm {

namespace {

// One process_vm_readv/writev call, repeated until every byte moved (the
// kernel may stop short, e.g. at a page it cannot pin); 0 or an errno.
int transfer(bool read, int pid, void* local, uint64_t remote, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    iovec l{static_cast<uint8_t*>(local) + done, bytes - done};
    iovec r{reinterpret_cast<void*>(remote + done), bytes - done};
    const ssize_t n = read ? process_vm_readv(pid, &l, 1, &r, 1, 0) : process_vm_writev(pid, &l, 1, &r, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

CmaChannel::CmaChannel(size_t min_bytes, Role role) : min_bytes_(min_bytes), role_(role) {}

void CmaChannel::publish(Rounds& rounds, const void* in, const void* out) const {
  CmaOffer* o = rounds.cma_slot();
  o->in = reinterpret_cast<uint64_t>(in);
  o->out = reinterpret_cast<uint64_t>(out);
  o->probe = 0;
}

void CmaChannel::take_offers(const Rounds& rounds) {
  const int n = rounds.size();
  in_.resize(n);
  out_.resize(n);
  for (int r = 0; r < n; ++r) {
    in_[r] = rounds.cma_of(r).in;
    out_[r] = rounds.cma_of(r).out;
  }
}

bool CmaChannel::confirm(Rounds& rounds, const OpDesc& desc, Deadline d) {
  if (state_ != State::kUnknown) return state_ == State::kWorks;
  // Every rank offered, so every op's largest buffer has at least
  // min_bytes (> 0) and every input at least one byte: read one byte of
  // each peer's.
  bool reached = true;
  for (int r = 0; r < rounds.size(); ++r) {
    if (r == rounds.rank()) continue;
    uint8_t byte = 0;
    reached = reached && transfer(true, rounds.pid_of(r), &byte, in_[r], 1) == 0;
  }
  rounds.cma_slot()->probe = reached ? 1 : 2;
  rounds.barrier_round(desc, d);
  bool all = true;
  for (int r = 0; r < rounds.size(); ++r) all = all && rounds.cma_of(r).probe == 1;
  state_ = all ? State::kWorks : State::kRefused;
  return all;
}

void CmaChannel::read(Rounds& rounds, int r, void* local, uint64_t remote, size_t bytes, const OpDesc& desc) {
  if (const int err = transfer(true, rounds.pid_of(r), local, remote, bytes)) fail(rounds, r, "process_vm_readv", err, desc);
}

void CmaChannel::write(Rounds& rounds, int r, const void* local, uint64_t remote, size_t bytes,
                       const OpDesc& desc) {
  if (const int err = transfer(false, rounds.pid_of(r), const_cast<void*>(local), remote, bytes)) {
    fail(rounds, r, "process_vm_writev", err, desc);
  }
}

uint8_t* CmaChannel::scratch(size_t bytes) {
  if (scratch_.size() < bytes + 64) scratch_.resize(bytes + 64);
  auto p = reinterpret_cast<uintptr_t>(scratch_.data());
  return scratch_.data() + ((64 - p % 64) % 64);
}

void CmaChannel::fail(Rounds& rounds, int r, const char* call, int err, const OpDesc& desc) {
  Waiter& w = rounds.waiter();
  const std::string msg = describe(desc) + ": " + call + " with rank " + std::to_string(w.global(r)) + " failed: " +
                          std::strerror(err);
  w.fail(err == ESRCH ? AbortKind::kPeerFailure : AbortKind::kOther, r, msg);
}

}  // namespace tdist::comm::shm
