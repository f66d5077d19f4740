// What a collective must cost at least on one host: the model behind the
// "ceiling" columns of `tdist-bench collectives`.
//
// Sizes are as nccl-tests reports them: S is the per-rank buffer (the
// all_reduce buffer, all_gather's output, reduce_scatter's input). busbw is
// algbw (S / time) times the bus factor, which makes the figures of one op
// comparable across world sizes.
//
// The memory model: every byte a collective must read from memory and every
// byte it must write costs memory traffic, and memcpy (which reads a byte
// and writes a byte per byte copied) measures what the machine's cores move
// together, B bytes copied per second. A collective that moves T bytes
// (reads plus writes, all ranks together) therefore takes at least
// T / (2 B). The T per op, with n ranks, each input read once and each
// output written once:
//   all_reduce      2 n S        (n inputs of S read, n outputs of S written)
//   reduce_scatter  (n + 1) S    (n inputs of S read, n outputs of S/n written)
//   all_gather      (n + 1) S    (n inputs of S/n read, n outputs of S written)
//   broadcast       n S          (root's S read, n - 1 outputs written)
//   reduce          (n + 1) S    (n inputs read, root's output written)
//   all_to_all      2 n S        (every input read, every output written)
// B is the memcpy rate of min(n, cores) cores: the all-core figure when the
// ranks fill the machine, else n times the one-core figure (capped at the
// all-core one).
#pragma once

#include <algorithm>
#include <string>

namespace tdist::bench {

inline double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") return double(n - 1) / n;
  return 1.0;  // broadcast, reduce
}

// T / S for the op at world size n (see above).
inline double traffic_per_byte(const std::string& op, int n) {
  if (op == "all_reduce" || op == "all_to_all") return 2.0 * n;
  if (op == "broadcast") return n;
  return n + 1.0;  // reduce_scatter, all_gather, reduce
}

// Bytes copied per second by the cores n ranks can use.
inline double usable_copy_rate(int n, int cores, double one_core, double all_cores) {
  if (n >= cores) return all_cores;
  return std::min(all_cores, n * one_core);
}

// The shortest time (seconds) the op can take on S bytes, and the busbw
// (bytes/s) that time would show; 0 when the copy rate is unknown.
inline double ceiling_seconds(const std::string& op, int n, double s_bytes, double copy_rate) {
  return copy_rate > 0 ? traffic_per_byte(op, n) * s_bytes / (2.0 * copy_rate) : 0.0;
}
inline double ceiling_busbw(const std::string& op, int n, double copy_rate) {
  // busbw = bus_factor * S / t, with t = T S / (2 B): S cancels.
  return copy_rate > 0 ? bus_factor(op, n) * 2.0 * copy_rate / traffic_per_byte(op, n) : 0.0;
}

}  // namespace tdist::bench
