// ProcessGroup::Impl: what a group is made of. The group's identity (its
// ranks, name, backend, timeout, private store), its comm::Backend, the
// TaskQueue its ops run on, and, with TDIST_DEBUG=detail, the fingerprint
// check. process_group.cpp maps tensor ops onto it; init.cpp builds it.
//
// Threading: the identity is immutable after construction; enqueue may be
// called from any thread (TaskQueue's contract); next_subgroup is the
// caller's thread only (new_group is collective and so called in order).
// Lifetime: stop() (ProcessGroup's destructor) drains the queue before the
// backend goes: queued ops use the backend.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/backend.h"
#include "process_group/fingerprint.h"
#include "process_group/task_queue.h"
#include "process_group/tensor_util.h"
#include "tdist/process_group.h"

namespace tdist {

struct ProcessGroup::Impl {
  std::unique_ptr<comm::Backend> backend;
  std::shared_ptr<Store> store;  // private to this group
  int rank = 0;
  int size = 1;
  std::vector<int> ranks;
  std::string backend_name;
  std::string group_name;
  Milliseconds timeout = kDefaultCollectiveTimeout;
  std::string master_addr;  // handed to network backends
  int next_subgroup = 0;
  std::optional<detail::FingerprintCheck> fingerprints;  // TDIST_DEBUG=detail
  mutable std::mutex counts_mu;  // enqueue may run on any thread
  std::map<std::string, CollectiveCount> counts;
  std::unique_ptr<detail::TaskQueue> queue;  // last: started once the rest is set

  void start() { queue = std::make_unique<detail::TaskQueue>(group_name); }
  void stop() {
    if (queue) queue->stop();
  }

  // Queues an op and counts it (collective_counts) with the bytes of this
  // rank's input and output. With TDIST_DEBUG=detail, a non-empty
  // fingerprint is checked across ranks just before the op runs.
  struct Traffic {
    int64_t input_bytes = 0;
    int64_t output_bytes = 0;
  };
  std::shared_ptr<Work> enqueue(const char* name, Traffic traffic, const std::optional<Milliseconds>& t,
                                detail::TaskBody body, std::string fingerprint = "") {
    if (fingerprints && !fingerprint.empty()) {
      body = [this, fp = std::move(fingerprint), inner = std::move(body)](comm::Deadline d) {
        fingerprints->check(fp, d);
        return inner(d);
      };
    }
    const Milliseconds to = t.value_or(timeout);
    if (to.count() <= 0) throw UsageError(std::string(name) + ": the timeout must be positive");
    auto work = queue->enqueue(name, to, std::move(body));
    std::lock_guard<std::mutex> lock(counts_mu);
    CollectiveCount& c = counts[name];
    ++c.calls;
    c.input_bytes += traffic.input_bytes;
    c.output_bytes += traffic.output_bytes;
    return work;
  }

  comm::DataType check(const at::Tensor& t, const char* op, const char* what = "tensor") const {
    return detail::check_tensor(t, op, what, backend->supports_cuda());
  }

  // Point-to-point and root arguments are group ranks.
  void check_rank(int r, const char* op, const char* what) const {
    if (r < 0 || r >= size) {
      throw UsageError(std::string(op) + ": " + what + " " + std::to_string(r) + " is not a rank of group '" +
                       group_name + "' (size " + std::to_string(size) + ")");
    }
  }
};

}  // namespace tdist
