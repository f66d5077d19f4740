// Point to point: send and recv through a ring buffer per ordered pair of
// ranks in the group segment.
//
// A message is a header (tag, bytes) and its bytes, written into the ring
// from sender to receiver; the ring's head (bytes written) and tail (bytes
// consumed) are the only shared state, stored with release and loaded with
// acquire, and every move of either wakes waiters (Waiter::notify).
//
// Contract:
// - One PointToPoint per rank, used by the backend's collective thread only
//   (it keeps the messages that arrived under other tags); not thread-safe.
// - send blocks while the ring to dst is full: a message larger than the
//   ring (ring_bytes) waits for the receiver, so two ranks that both send
//   large messages before receiving deadlock until the deadline.
// - recv blocks until a message from src with its tag arrives; messages
//   with other tags that come first are kept for later recvs. A message of
//   another size than asked for aborts the group (CollectiveMismatchError).
// - Both raise as Waiter::wait_until does, and UsageError for a peer that
//   is not another rank of the group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "comm/backend.h"
#include "comm/shm/segment.h"
#include "comm/shm/waiter.h"

namespace tdist::comm::shm {

class PointToPoint {
 public:
  PointToPoint(const GroupSegment& segment, Waiter& waiter);

  void send(const void* buf, size_t bytes, int dst, int tag, Deadline d);
  void recv(void* buf, size_t bytes, int src, int tag, Deadline d);

 private:
  struct Unexpected {
    int src;
    int64_t tag;
    std::vector<uint8_t> data;
  };

  void ring_write(Ring& ring, uint8_t* data, const void* src, size_t bytes, int dst, int tag, Deadline d);
  void ring_read(Ring& ring, const uint8_t* data, void* dst_buf, size_t bytes, int src, int tag, Deadline d);
  void check_peer(int peer, const char* op) const;
  void check_recv_size(size_t got, size_t want, int src, int tag);

  const GroupSegment& seg_;
  Waiter& waiter_;
  int rank_;
  std::deque<Unexpected> unexpected_;
};

}  // namespace tdist::comm::shm
