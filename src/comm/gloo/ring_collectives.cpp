// The ring reduce-scatter and all-gather; the contract is in
// ring_collectives.h.
#include "comm/gloo/ring_collectives.h"

#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "comm/reduce.h"
#include "tdist/errors.h"

namespace tdist::comm::gloo_backend {

namespace {

// Slots of this op's messages: a prefix no Gloo collective uses (they put
// 0x01..0x08 in the top byte; tdist's send/recv use 1 << 40), the op's
// tag, and the message's index (segment and step).
uint64_t slot_of(uint32_t tag, uint64_t index) { return (uint64_t{0x40} << 56) | (uint64_t{tag} << 24) | index; }

bool overlaps(const uint8_t* a, size_t a_len, const uint8_t* b, size_t b_len) { return a < b + b_len && b < a + a_len; }

std::chrono::milliseconds left(Deadline d) {
  return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(d - Clock::now()));
}
void wait_send(::gloo::transport::UnboundBuffer& ub, Deadline d, const char* op) {
  if (!ub.waitSend(left(d))) throw TimeoutError(std::string("ring ") + op + ": a send was aborted");
}
void wait_recv(::gloo::transport::UnboundBuffer& ub, Deadline d, const char* op) {
  if (!ub.waitRecv(left(d))) throw TimeoutError(std::string("ring ") + op + ": a receive was aborted");
}

}  // namespace

void ring_reduce_scatter(::gloo::Context& context, const void* in, void* out, size_t count, DataType t, ReduceOp op,
                         uint32_t tag, Deadline deadline, std::vector<uint8_t>& scratch) {
  const int n = context.size, r = context.rank;
  const size_t es = dtype_size(t);
  const size_t chunk_bytes = count * es;
  const auto* input = static_cast<const uint8_t*>(in);
  auto* output = static_cast<uint8_t*>(out);
  if (n == 1) {
    if (output != input) std::copy(input, input + chunk_bytes, output);
    return;
  }
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  const size_t seg_elems = std::max<size_t>(1, std::min(count, kSegmentBytes / es));
  // The running sum travels in `acc`: the output's segment, unless the
  // output overlaps the input (whose slices every step still reads).
  const bool aliased = overlaps(output, chunk_bytes, input, chunk_bytes * n);
  scratch.resize(seg_elems * es * (aliased ? 2 : 1));
  uint8_t* recv_buf = scratch.data();
  const size_t segments = (count + seg_elems - 1) / seg_elems;
  if (segments * static_cast<size_t>(n) >= (size_t{1} << 24)) {
    throw UsageError("gloo reduce_scatter: " + std::to_string(count) + " elements per rank make too many segments");
  }
  auto recv_ub = context.createUnboundBuffer(recv_buf, seg_elems * es);
  auto in_ub = context.createUnboundBuffer(const_cast<uint8_t*>(input), chunk_bytes * n);  // sent from, never written
  for (size_t g = 0; g < segments; ++g) {
    const size_t first = g * seg_elems, len = std::min(seg_elems, count - first);
    const size_t bytes = len * es;
    uint8_t* acc = aliased ? scratch.data() + seg_elems * es : output + first * es;
    auto acc_ub = context.createUnboundBuffer(acc, bytes);
    auto slice = [&](int chunk) { return first * es + static_cast<size_t>(chunk) * chunk_bytes; };  // in's offset
    for (int s = 0; s < n - 1; ++s) {
      const int send_chunk = ((r - s - 1) % n + n) % n, recv_chunk = ((r - s - 2) % n + n) % n;
      const uint64_t index = g * static_cast<uint64_t>(n) + static_cast<uint64_t>(s);
      recv_ub->recv(left, slot_of(tag, index), 0, bytes);  // posted before the matching send anywhere
      if (s == 0) {
        in_ub->send(right, slot_of(tag, index), slice(send_chunk), bytes);
      } else {
        acc_ub->send(right, slot_of(tag, index), 0, bytes);
      }
      wait_recv(*recv_ub, deadline, "reduce_scatter");
      wait_send(s == 0 ? *in_ub : *acc_ub, deadline, "reduce_scatter");
      const void* parts[] = {recv_buf, input + slice(recv_chunk)};
      reduce_many(acc, parts, 2, len, t, op, 1);
    }
    if (aliased) std::copy(acc, acc + bytes, output + first * es);
  }
}

void ring_all_gather(::gloo::Context& context, const void* in, void* out, size_t bytes, uint32_t tag,
                     Deadline deadline) {
  const int n = context.size, r = context.rank;
  auto* output = static_cast<uint8_t*>(out);
  auto* mine = output + static_cast<size_t>(r) * bytes;
  if (in != mine) std::memmove(mine, in, bytes);  // memmove: `in` may overlap another rank's slice
  if (n == 1 || bytes == 0) return;
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  const size_t total = bytes * static_cast<size_t>(n);
  // One buffer for the sends, one for the receives, both over the output:
  // a step sends one chunk while the next chunk arrives in another place.
  auto send_ub = context.createUnboundBuffer(output, total);
  auto recv_ub = context.createUnboundBuffer(output, total);
  for (int s = 0; s < n - 1; ++s) {
    const size_t send_chunk = static_cast<size_t>((r - s + n) % n), recv_chunk = static_cast<size_t>((r - s - 1 + 2 * n) % n);
    const uint64_t slot = slot_of(tag, static_cast<uint64_t>(s));
    recv_ub->recv(left, slot, recv_chunk * bytes, bytes);
    send_ub->send(right, slot, send_chunk * bytes, bytes);
    wait_recv(*recv_ub, deadline, "all_gather");
    wait_send(*send_ub, deadline, "all_gather");
  }
}

}  // namespace tdist::comm::gloo_backend
