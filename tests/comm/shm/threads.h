// Ranks of an shm group as threads of this process: each thread maps the
// group segment on its own, as a process would, over one shared HashStore.
// For the pieces of the shm backend below ShmBackend (src/comm/shm).
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/shm/rounds.h"
#include "comm/shm/segment.h"
#include "comm/shm/waiter.h"
#include "tdist/store.h"

namespace tdist::test::shm {

using namespace std::chrono_literals;

// One rank's view of the group: its mapping, waiter and rounds.
struct Member {
  Member(const comm::BackendContext& ctx, size_t round_bytes, size_t ring_bytes, std::chrono::microseconds yield)
      : segment(ctx, round_bytes, ring_bytes),
        waiter(segment, ctx.rank, ctx.global_ranks, std::chrono::microseconds(0), yield),
        rounds(segment, waiter) {}
  comm::shm::GroupSegment segment;
  comm::shm::Waiter waiter;
  comm::shm::Rounds rounds;
};

struct GroupOptions {
  int size = 2;
  size_t round_bytes = 4096;
  size_t ring_bytes = 4096;
  std::chrono::microseconds yield{2000};
  std::vector<int> global_ranks;  // empty: the group ranks
  std::chrono::milliseconds timeout{10'000};
};

inline comm::BackendContext context(const std::shared_ptr<Store>& store, const GroupOptions& o, int rank) {
  comm::BackendContext ctx;
  ctx.store = store;
  ctx.rank = rank;
  ctx.size = o.size;
  ctx.global_ranks = o.global_ranks;
  ctx.group_name = "test";
  ctx.timeout = o.timeout;
  return ctx;
}

// Runs fn(rank) on o.size threads at once; returns what each raised (an
// empty exception_ptr for a rank that returned).
inline std::vector<std::exception_ptr> run_ranks(int size, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Attaches every rank as a Member, then runs fn(member) on each rank's
// thread.
inline std::vector<std::exception_ptr> run_group(const GroupOptions& o, const std::function<void(Member&)>& fn) {
  auto store = std::make_shared<HashStore>();
  return run_ranks(o.size, [&](int rank) {
    Member m(context(store, o, rank), o.round_bytes, o.ring_bytes, o.yield);
    fn(m);
  });
}

// The message of the exception in e ("" when none); rethrows non-std ones.
inline std::string message(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

template <typename E>
bool raised(const std::exception_ptr& e) {
  if (!e) return false;
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

inline comm::Deadline in(std::chrono::milliseconds ms) { return comm::Clock::now() + ms; }

}  // namespace tdist::test::shm
