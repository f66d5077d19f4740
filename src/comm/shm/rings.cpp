// PointToPoint: framing, tag matching and flow control over the per-pair
// rings. The contract is in rings.h.
#include "comm/shm/rings.h"

#include <algorithm>
#include <string>

#include "util/bytes.h"

namespace tdist::comm::shm {

namespace {

struct MsgHeader {
  int64_t tag;
  uint64_t bytes;
};

}  // namespace

PointToPoint::PointToPoint(const GroupSegment& segment, Waiter& waiter)
    : seg_(segment), waiter_(waiter), rank_(waiter.rank()) {}

void PointToPoint::send(const void* buf, size_t bytes, int dst, int tag, Deadline d) {
  waiter_.check_alive_state();
  check_peer(dst, "send");
  Ring& ring = *seg_.ring_of(rank_, dst);
  uint8_t* data = seg_.ring_data(rank_, dst);
  MsgHeader h{tag, bytes};
  ring_write(ring, data, &h, sizeof h, dst, tag, d);
  ring_write(ring, data, buf, bytes, dst, tag, d);
}

void PointToPoint::recv(void* buf, size_t bytes, int src, int tag, Deadline d) {
  waiter_.check_alive_state();
  check_peer(src, "recv");
  // A message that arrived earlier under another tag waits in `unexpected_`.
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    if (it->src == src && it->tag == tag) {
      check_recv_size(it->data.size(), bytes, src, tag);
      detail::copy_bytes(buf, it->data.data(), bytes);
      unexpected_.erase(it);
      return;
    }
  }
  Ring& ring = *seg_.ring_of(src, rank_);
  const uint8_t* data = seg_.ring_data(src, rank_);
  for (;;) {
    MsgHeader h{};
    ring_read(ring, data, &h, sizeof h, src, tag, d);
    if (h.tag == tag) {
      if (h.bytes != bytes) {
        // Drain it so the pair stays in step, then report.
        std::vector<uint8_t> sink(h.bytes);
        ring_read(ring, data, sink.data(), h.bytes, src, tag, d);
        check_recv_size(h.bytes, bytes, src, tag);
      }
      ring_read(ring, data, buf, bytes, src, tag, d);
      return;
    }
    Unexpected u{src, h.tag, std::vector<uint8_t>(h.bytes)};
    ring_read(ring, data, u.data.data(), h.bytes, src, tag, d);
    unexpected_.push_back(std::move(u));
  }
}

void PointToPoint::check_peer(int peer, const char* op) const {
  if (peer < 0 || peer >= seg_.size() || peer == rank_) {
    throw UsageError(std::string(op) + ": peer " + std::to_string(peer) + " is not another rank of this group of " +
                     std::to_string(seg_.size()));
  }
}

void PointToPoint::check_recv_size(size_t got, size_t want, int src, int tag) {
  if (got != want) {
    waiter_.fail(AbortKind::kMismatch, -1,
                 "recv from rank " + std::to_string(waiter_.global(src)) + " with tag " + std::to_string(tag) +
                     " expected " + std::to_string(want) + " bytes but the message has " + std::to_string(got));
  }
}

void PointToPoint::ring_write(Ring& ring, uint8_t* data, const void* src, size_t bytes, int dst, int tag, Deadline d) {
  const auto* p = static_cast<const uint8_t*>(src);
  const size_t cap = seg_.ring_bytes();
  uint64_t head = ring.head.load(std::memory_order_relaxed);
  while (bytes > 0) {
    uint64_t tail = ring.tail.load(std::memory_order_acquire);
    if (head - tail == cap) {
      waiter_.wait_until([&] { return head - ring.tail.load() < cap; },  // seq_cst: see Waiter::notify
                         [&] { return std::vector<int>{dst}; },
                         [&] { return "send to rank " + std::to_string(waiter_.global(dst)) + " (tag " + std::to_string(tag) + ")"; },
                         d);
      tail = ring.tail.load(std::memory_order_acquire);
    }
    const size_t pos = head % cap;
    const size_t len = std::min({bytes, cap - (head - tail), cap - pos});
    detail::copy_bytes(data + pos, p, len);
    head += len;
    p += len;
    bytes -= len;
    ring.head.store(head);  // seq_cst: see Waiter::notify
    waiter_.notify();
  }
}

void PointToPoint::ring_read(Ring& ring, const uint8_t* data, void* dst_buf, size_t bytes, int src, int tag,
                             Deadline d) {
  auto* p = static_cast<uint8_t*>(dst_buf);
  const size_t cap = seg_.ring_bytes();
  uint64_t tail = ring.tail.load(std::memory_order_relaxed);
  while (bytes > 0) {
    uint64_t head = ring.head.load(std::memory_order_acquire);
    if (head == tail) {
      waiter_.wait_until([&] { return ring.head.load() != tail; },  // seq_cst: see Waiter::notify
                         [&] { return std::vector<int>{src}; },
                         [&] { return "recv from rank " + std::to_string(waiter_.global(src)) + " (tag " + std::to_string(tag) + ")"; },
                         d);
      head = ring.head.load(std::memory_order_acquire);
    }
    const size_t pos = tail % cap;
    const size_t len = std::min({bytes, static_cast<size_t>(head - tail), cap - pos});
    detail::copy_bytes(p, data + pos, len);
    tail += len;
    p += len;
    bytes -= len;
    ring.tail.store(tail);  // seq_cst: see Waiter::notify
    waiter_.notify();
  }
}

}  // namespace tdist::comm::shm
