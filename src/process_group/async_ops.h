// AsyncOpsScope: the ops a thread queues while one lives are asynchronous:
// their caller goes on with other work (DDP's buckets launched during
// backward, FSDP's prefetches and gradient reduce-scatters) instead of
// waiting for them at once. The group's worker then takes them at once
// instead of after the grace period in which a waiting thread may claim a
// fresh op (task_queue.h). Scopes nest; each restores what it found.
#pragma once

namespace tdist::detail {

class AsyncOpsScope {
 public:
  AsyncOpsScope();
  ~AsyncOpsScope();
  AsyncOpsScope(const AsyncOpsScope&) = delete;
  AsyncOpsScope& operator=(const AsyncOpsScope&) = delete;

 private:
  bool outer_;
};

}  // namespace tdist::detail
