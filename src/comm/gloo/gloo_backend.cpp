// The gloo backend: Gloo's collectives over TCP, with rendezvous through our
// Store. The path to many hosts.
//
// Gloo reduces pairwise, so float16/bfloat16 sums round at every step here
// (the shm backend accumulates in float32); AVG is a SUM followed by a local
// division. Gloo raises an IoException when a peer's connection drops; to
// say which rank died, every rank beats a heartbeat key in the store, and
// after such an error the ranks whose heartbeat stopped are named.
#include "comm/gloo/gloo_backend.h"

#include <arpa/inet.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "comm/gloo/ring_collectives.h"
#include "comm/heartbeat.h"
#include "comm/op_label.h"
#include "comm/reduce.h"
#include "util/bytes.h"
#include "util/env.h"

namespace tdist::comm::gloo_backend {

namespace {

using std::chrono::milliseconds;

// Our Store as Gloo's rendezvous store.
class StoreAdapter : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<tdist::Store> store, milliseconds timeout) : store_(std::move(store)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    Bytes b = store_->get(key, timeout_);
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override { store_->wait(keys, timeout); }

 private:
  std::shared_ptr<tdist::Store> store_;
  milliseconds timeout_;
};

// The local address that routes to `host`: the interface peers can reach us
// on. Empty when it cannot be found.
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), "9", &hints, &res) != 0) return "";
  std::string out;
  int fd = socket(res->ai_family, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {  // UDP: no packet is sent
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET6_ADDRSTRLEN] = {0};
      const void* addr = local.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                                                     : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (inet_ntop(local.ss_family, addr, buf, sizeof buf)) out = buf;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return out;
}

milliseconds remaining(Deadline d) {
  auto left = std::chrono::duration_cast<milliseconds>(d - Clock::now());
  return std::max(left, milliseconds(1));
}

// Gloo's typed setters only use the type's size: pick a type of that size.
template <typename Fn>
void with_element_type(size_t size, Fn&& fn) {
  switch (size) {
    case 1: fn(uint8_t{}); return;
    case 2: fn(uint16_t{}); return;
    case 4: fn(uint32_t{}); return;
    case 8: fn(uint64_t{}); return;
  }
  throw UsageError("gloo backend: unsupported element size " + std::to_string(size));
}

// Gloo writes to its sockets with writev, which cannot ask for
// MSG_NOSIGNAL: a write to a peer that has just died raises SIGPIPE, whose
// default action ends this rank before Gloo can report the broken
// connection (a test saw "rank 0: signal 13" instead of a
// PeerFailureError). As Python does at startup (so every PyTorch job),
// SIGPIPE is ignored while its action is the default; a handler the
// program installed, or an ignore, is kept. The write then fails with
// EPIPE, which Gloo raises as an IoException.
void ignore_default_sigpipe() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) != 0 || (old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL) return;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  (void)sigaction(SIGPIPE, &ignore, nullptr);
}

class GlooBackend final : public Backend {
 public:
  GlooBackend(const BackendContext& ctx, const GlooOptions& options) : Backend(ctx.rank, ctx.size), ctx_(ctx) {
    ignore_default_sigpipe();
    ::gloo::transport::tcp::attr attr;
    if (!options.iface.empty()) {
      attr.iface = options.iface;
    } else if (!options.hostname.empty()) {
      attr.hostname = options.hostname;
    } else {
      std::string local = local_address_towards(ctx.master_addr);
      if (local.empty()) {
        char host[256] = {0};
        gethostname(host, sizeof host - 1);
        local = host;
      }
      attr.hostname = local;
    }
    try {
      device_ = ::gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<::gloo::rendezvous::Context>(ctx.rank, ctx.size);
      context->setTimeout(ctx.timeout);
      StoreAdapter store(std::make_shared<PrefixStore>("gloo", ctx.store), ctx.timeout);
      context->connectFullMesh(store, device_);
      context_ = context;
    } catch (const ::gloo::Exception& e) {
      throw NetworkError("gloo backend, rank " + std::to_string(global(rank())) + ": cannot connect the group: " +
                         e.what() + ". Set TDIST_GLOO_IFNAME to the network interface the ranks share");
    }
    hb_ = std::make_unique<Heartbeat>(ctx.store, ctx.rank, ctx.size, ctx.global_ranks);
    sender_ = std::thread([this] { reap_sends(); });
  }

  ~GlooBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (sender_.joinable()) sender_.join();  // after the queued sends are delivered or time out
  }

  std::string name() const override { return "gloo"; }

  void all_reduce(void* buf, size_t count, DataType t, ReduceOp op, Deadline d) override {
    check_reduction(t, op);
    run(OpKind::kAllReduce, d, [&] {
      if (count == 0) return;
      ::gloo::AllreduceOptions o(context_);
      set_io(o, buf, buf, count, dtype_size(t));
      o.setReduceFunction(reducer(t, op));
      o.setTag(next_tag());
      o.setTimeout(remaining(d));
      ::gloo::allreduce(o);
      if (op == ReduceOp::kAvg) scale(buf, count, t);
    });
  }

  void broadcast(void* buf, size_t bytes, int root, Deadline d) override {
    run(OpKind::kBroadcast, d, [&] {
      if (bytes == 0) return;
      // Output only: with no input the root broadcasts in place (an input
      // buffer on the same memory would make Gloo copy it onto itself while
      // sending it).
      ::gloo::BroadcastOptions o(context_);
      o.setOutput(static_cast<uint8_t*>(buf), bytes);
      o.setRoot(root);
      o.setTag(next_tag());
      o.setTimeout(remaining(d));
      ::gloo::broadcast(o);
    });
  }

  void reduce(void* buf, size_t count, DataType t, ReduceOp op, int root, Deadline d) override {
    check_reduction(t, op);
    run(OpKind::kReduce, d, [&] {
      if (count == 0) return;
      const size_t bytes = count * dtype_size(t);
      // Gloo uses the output as scratch on every rank; keep non-roots' intact.
      std::vector<uint8_t> scratch(rank() == root ? 0 : bytes);
      void* out = rank() == root ? buf : scratch.data();
      ::gloo::ReduceOptions o(context_);
      with_element_type(dtype_size(t), [&](auto e) {
        using E = decltype(e);
        o.setInput(static_cast<E*>(buf), count);
        o.setOutput(static_cast<E*>(out), count);
      });
      o.setRoot(root);
      o.setReduceFunction(reducer(t, op));
      o.setTag(next_tag());
      o.setTimeout(remaining(d));
      ::gloo::reduce(o);
      if (op == ReduceOp::kAvg && rank() == root) scale(buf, count, t);
    });
  }

  void all_gather(const void* in, void* out, size_t bytes, Deadline d) override {
    run(OpKind::kAllGather, d, [&] {
      if (bytes == 0) return;
      // A ring of Gloo's pairs (ring_collectives.h): both directions of
      // each link busy at once, the chunks straight into the output.
      ring_all_gather(*context_, in, out, bytes, next_tag(), d);
    });
  }

  void reduce_scatter(const void* in, void* out, size_t count, DataType t, ReduceOp op, Deadline d) override {
    check_reduction(t, op);
    run(OpKind::kReduceScatter, d, [&] {
      if (count == 0) return;
      // A ring of Gloo's pairs (ring_collectives.h): (N-1)/N of the
      // input on the wire, one segment of scratch.
      ring_reduce_scatter(*context_, in, out, count, t, op == ReduceOp::kAvg ? ReduceOp::kSum : op, next_tag(), d,
                          ring_scratch_);
      if (op == ReduceOp::kAvg) scale(out, count, t);
    });
  }

  void gather(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    run(OpKind::kGather, d, [&] {
      if (bytes == 0) return;
      ::gloo::GatherOptions o(context_);
      o.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)), bytes);
      if (rank() == root) o.setOutput(static_cast<uint8_t*>(out), bytes * size());
      o.setRoot(root);
      o.setTag(next_tag());
      o.setTimeout(remaining(d));
      ::gloo::gather(o);
    });
  }

  void scatter(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    run(OpKind::kScatter, d, [&] {
      if (bytes == 0) return;
      ::gloo::ScatterOptions o(context_);
      std::vector<uint8_t*> ins;
      if (rank() == root) {
        for (int r = 0; r < size(); ++r) ins.push_back(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)) + r * bytes);
        o.setInputs(ins, bytes);
      }
      o.setOutput(static_cast<uint8_t*>(out), bytes);
      o.setRoot(root);
      o.setTag(next_tag());
      o.setTimeout(remaining(d));
      ::gloo::scatter(o);
    });
  }

  void all_to_all(const void* in, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  void* out, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  Deadline d) override {
    run(OpKind::kAllToAll, d, [&] {
      // Gloo wants the pieces back to back in rank order.
      size_t in_total = 0, out_total = 0;
      for (int r = 0; r < size(); ++r) {
        if (send_offsets[r] != in_total || recv_offsets[r] != out_total) {
          throw UsageError("gloo all_to_all: pieces must be contiguous and in rank order");
        }
        in_total += send_bytes[r];
        out_total += recv_bytes[r];
      }
      // Gloo cannot tell a size mismatch from a slow peer: check sizes first
      // through an all-gather of everyone's send and receive sizes.
      std::vector<uint64_t> mine(2 * size()), all(2 * size() * size());
      for (int r = 0; r < size(); ++r) {
        mine[r] = send_bytes[r];
        mine[size() + r] = recv_bytes[r];
      }
      {
        ::gloo::AllgatherOptions o(context_);
        o.setInput(mine.data(), mine.size());
        o.setOutput(all.data(), all.size());
        o.setTag(next_tag());
        o.setTimeout(remaining(d));
        ::gloo::allgather(o);
      }
      const int n = size();
      for (int s = 0; s < n; ++s) {
        for (int r = 0; r < n; ++r) {
          const uint64_t sends = all[s * 2 * n + r], receives = all[r * 2 * n + n + s];
          if (sends != receives) {
            throw CollectiveMismatchError("gloo backend, rank " + std::to_string(global(rank())) + ": all_to_all: rank " +
                                          std::to_string(global(s)) + " sends " + std::to_string(sends) + " bytes to rank " +
                                          std::to_string(global(r)) + ", which expects " + std::to_string(receives));
          }
        }
      }
      std::vector<int64_t> in_counts(send_bytes.begin(), send_bytes.end()), out_counts(recv_bytes.begin(), recv_bytes.end());
      if (in_total == 0 && out_total == 0) return;
      std::vector<uint8_t> dummy_in(in_total ? 0 : 1), dummy_out(out_total ? 0 : 1);
      ::gloo::AlltoallvOptions o(context_);
      o.setInput(in_total ? const_cast<uint8_t*>(static_cast<const uint8_t*>(in)) : dummy_in.data(), in_counts);
      o.setOutput(out_total ? static_cast<uint8_t*>(out) : dummy_out.data(), out_counts);
      o.setTag(next_tag());
      o.setTimeout(remaining(d));
      ::gloo::alltoallv(o);
    });
  }

  void barrier(Deadline d) override {
    run(OpKind::kBarrier, d, [&] {
      ::gloo::BarrierOptions o(context_);
      o.setTag(next_tag());
      o.setTimeout(remaining(d));
      ::gloo::barrier(o);
    });
  }

  // Gloo delivers a send only once the receiver posts its recv, so a blocking
  // send would stall this group's queue (and deadlock a ring of sends). Sends
  // are buffered instead: the payload is copied, posted, and reaped by the
  // sender thread; a failed delivery surfaces at the next op.
  void send(const void* buf, size_t bytes, int dst, int tag, Deadline d) override {
    run(OpKind::kSend, d, [&] {
      auto pending = std::make_unique<PendingSend>();
      pending->data.assign(static_cast<const uint8_t*>(buf), static_cast<const uint8_t*>(buf) + bytes);
      pending->data.resize(std::max<size_t>(bytes, 1));
      pending->ub = context_->createUnboundBuffer(pending->data.data(), bytes);
      pending->deadline = d;
      pending->what = "send #" + std::to_string(op_label_or(seq_)) + " to rank " + std::to_string(global(dst));
      pending->ub->send(dst, p2p_slot(tag), 0, bytes);
      {
        std::lock_guard<std::mutex> lock(mu_);
        sends_.push_back(std::move(pending));
      }
      cv_.notify_all();
    });
  }

  void recv(void* buf, size_t bytes, int src, int tag, Deadline d) override {
    run(OpKind::kRecv, d, [&] {
      std::vector<uint8_t> empty(1);
      void* p = bytes ? buf : empty.data();
      auto ub = context_->createUnboundBuffer(p, bytes);
      ub->recv(src, p2p_slot(tag), 0, bytes);
      if (!ub->waitRecv(remaining(d))) throw TimeoutError("recv timed out");
    });
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_error_) first_error_ = std::make_exception_ptr(Error("gloo backend aborted: " + reason));
  }

 private:
  uint32_t next_tag() { return static_cast<uint32_t>(tag_++ & 0x3fffffff); }
  static uint64_t p2p_slot(int tag) { return (uint64_t(1) << 40) + static_cast<uint32_t>(tag); }
  int global(int r) const {
    return r >= 0 && r < static_cast<int>(ctx_.global_ranks.size()) ? ctx_.global_ranks[r] : r;
  }

  template <typename Opts>
  void set_io(Opts& o, void* in, void* out, size_t count, size_t es) {
    with_element_type(es, [&](auto e) {
      using E = decltype(e);
      o.setInput(static_cast<E*>(in), count);
      o.setOutput(static_cast<E*>(out), count);
    });
  }

  // Gloo's reduce function: c = a op b over n elements.
  static ::gloo::AllreduceOptions::Func reducer(DataType t, ReduceOp op) {
    const ReduceOp pairwise = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    return [t, pairwise](void* c, const void* a, const void* b, size_t n) {
      const void* in[] = {a, b};
      reduce_many(c, in, 2, n, t, pairwise, 1);
    };
  }

  void scale(void* buf, size_t count, DataType t) {
    const void* in[] = {buf};
    reduce_many(buf, in, 1, count, t, ReduceOp::kAvg, size());
  }

  // Runs one op: fails fast after an earlier error, and turns Gloo's
  // exceptions into tdist's, naming the op and, for a lost connection, the
  // rank whose heartbeat stopped.
  template <typename Fn>
  void run(OpKind kind, Deadline d, Fn&& fn) {
    const uint64_t seq = seq_++;
    hb_->set_ops_started(seq_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (first_error_) std::rethrow_exception(first_error_);
    }
    const std::string what = std::string(op_kind_name(kind)) + " #" + std::to_string(op_label_or(seq + 1));
    const std::string who = "gloo backend, rank " + std::to_string(global(rank())) + ": ";
    try {
      fn();
      return;
    } catch (const CollectiveMismatchError&) {
      remember(std::current_exception());
      throw;
    } catch (const TimeoutError& e) {
      remember(std::make_exception_ptr(TimeoutError(who + what + " timed out; " + hb_->missing_ranks(seq) + ": " + e.what())));
    } catch (const ::gloo::IoException& e) {
      const std::string msg = e.what();
      if (msg.find("Timed out") != std::string::npos || Clock::now() >= d) {
        remember(std::make_exception_ptr(TimeoutError(who + what + " timed out; " + hb_->missing_ranks(seq) + " (" + msg + ")")));
      } else {
        remember(peer_failure(who + what + " failed: " + msg));
      }
    } catch (const ::gloo::Exception& e) {
      remember(std::make_exception_ptr(Error(who + what + " failed: " + e.what())));
    }
    std::lock_guard<std::mutex> lock(mu_);
    std::rethrow_exception(first_error_);
  }

  void remember(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_error_) first_error_ = std::move(e);
  }

  struct PendingSend {
    std::vector<uint8_t> data;
    std::unique_ptr<::gloo::transport::UnboundBuffer> ub;
    Deadline deadline;
    std::string what;
  };

  void reap_sends() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !sends_.empty(); });
      if (sends_.empty()) return;  // stopping, and nothing left to deliver
      std::unique_ptr<PendingSend> s = std::move(sends_.front());
      sends_.pop_front();
      lock.unlock();
      try {
        s->ub->waitSend(remaining(s->deadline));
      } catch (const ::gloo::Exception& e) {
        const std::string who = "gloo backend, rank " + std::to_string(global(rank())) + ": ";
        const std::string msg = e.what();
        remember(msg.find("Timed out") != std::string::npos
                     ? std::make_exception_ptr(TimeoutError(who + s->what + " was never received (" + msg + ")"))
                     : peer_failure(who + s->what + " failed: " + msg));
      }
      lock.lock();
    }
  }

  // ---- liveness ------------------------------------------------------------

  // After a lost connection: which ranks stopped beating?
  std::exception_ptr peer_failure(const std::string& msg) {
    const std::vector<int> dead = hb_->dead_ranks();
    if (dead.empty()) return std::make_exception_ptr(NetworkError(msg));
    return std::make_exception_ptr(
        PeerFailureError(msg + "; " + hb_->describe(dead) + " stopped answering (heartbeat lost)", global(dead[0])));
  }

  BackendContext ctx_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::Context> context_;
  // The ring reduce-scatter's scratch, kept: Gloo may still write into a
  // receive posted by an op that failed.
  std::vector<uint8_t> ring_scratch_;
  uint64_t tag_ = 1;
  uint64_t seq_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::exception_ptr first_error_;
  std::deque<std::unique_ptr<PendingSend>> sends_;
  std::unique_ptr<Heartbeat> hb_;
  std::thread sender_;
};

}  // namespace

GlooOptions GlooOptions::from_env() {
  GlooOptions o;
  for (const char* name : {"TDIST_GLOO_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    if (const char* v = std::getenv(name); v && *v) {
      o.iface = v;
      break;
    }
  }
  if (const char* v = std::getenv("TDIST_GLOO_HOSTNAME"); v && *v) o.hostname = v;
  return o;
}

std::unique_ptr<Backend> make_gloo_backend(const BackendContext& ctx, const GlooOptions& options) {
  return std::make_unique<GlooBackend>(ctx, options);
}

}  // namespace tdist::comm::gloo_backend
