// GroupSegment: creating, sizing, mapping and unlinking the group's
// segment, its names, and the sweep of dead processes' segments. The
// contract is in segment.h.
#include "comm/shm/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <new>
#include <random>

#include "comm/shm/process_info.h"
#include "comm/shm/shm_backend.h"
#include "util/env.h"
#include "util/private_file.h"

namespace tdist::comm::shm {

namespace {

constexpr uint64_t kMagic = 0x316d737473696474ull;  // "tdistsm1"
// 5: OpDesc.history, Slot.prev (eager ops); 6: RoundLine (a line per parity, the box);
// 7: OpDesc.history hashed a word at a time (rounds.cpp): ranks of 6 and 7 would disagree on it.
constexpr uint32_t kVersion = 7;

}  // namespace

std::string new_segment_name(const std::string& tag) {
  std::random_device rd;
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, "%08x%08x", rd(), rd());
  return "/" + std::string(kSegmentPrefix) + std::to_string(getpid()) + "-" + suffix + tag;
}

std::string reserve_shm(int fd, size_t bytes) {
  int err;
  do {
    err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (err == EINTR);
  if (err == 0) return "";
  std::string free_text = "unknown";
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) == 0) {
    free_text = std::to_string(static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize) + " bytes free of " +
                std::to_string(static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize);
  }
  return "cannot reserve " + std::to_string(bytes) + " bytes of /dev/shm (" + free_text + "): " +
         detail::errno_string(err) +
         ". Enlarge /dev/shm (docker: --shm-size; mount -o remount,size=... /dev/shm) or lower TDIST_SHM_* buffer sizes";
}

void* map_and_close(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int err = errno;
  close(fd);
  errno = err;
  return p;
}

int sweep_stale_segments() {
  int removed = 0;
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  const std::string prefix = kSegmentPrefix;
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    auto pid = detail::parse_int(name.substr(prefix.size(), name.find('-', prefix.size()) - prefix.size()));
    if (!pid || *pid <= 0) continue;
    if (!pid_alive(static_cast<int>(*pid)) || process_start_time(static_cast<int>(*pid)) == 0) {
      if (shm_unlink(("/" + name).c_str()) == 0) ++removed;
    }
  }
  closedir(dir);
  return removed;
}

GroupSegment::GroupSegment(const BackendContext& ctx, size_t round_bytes, size_t ring_bytes)
    : rank_(ctx.rank), size_(ctx.size), round_bytes_(round_bytes), ring_bytes_(ring_bytes) {
  attach(ctx);
}

GroupSegment::~GroupSegment() {
  if (base_) munmap(base_, total_);
}

void GroupSegment::attach(const BackendContext& ctx) {
  const int n = size_;
  const size_t header_bytes = slots_offset();
  const size_t slots = align_up(sizeof(Slot) * n, kAlign);
  const size_t staging = size_t(n) * 2 * round_bytes_;
  const size_t rings = size_t(n) * n * (align_up(sizeof(Ring), kAlign) + ring_bytes_);
  total_ = header_bytes + slots + staging + rings;
  slots_off_ = header_bytes;
  staging_off_ = header_bytes + slots;
  rings_off_ = staging_off_ + staging;

  Store& store = *ctx.store;
  const int global = rank_ < static_cast<int>(ctx.global_ranks.size()) ? ctx.global_ranks[rank_] : rank_;
  std::string name;
  int fd = -1;
  // Rank 0's failures to make the segment: the other ranks wait for its
  // name, so they get the reason instead (names start with '/') and every
  // rank fails with it rather than with a vanished store.
  auto refuse = [&](const std::string& why) {
    const std::string text = "rank " + std::to_string(global) + " " + why;
    store.set("shm/segment", "!" + text);
    // The store may live in this process: stay until the others have read
    // the reason (briefly; they may be gone already).
    if (n > 1) {
      try {
        store.wait({"shm/reason_heard"}, std::min<Milliseconds>(ctx.timeout, std::chrono::seconds(10)));
      } catch (const Error&) {
      }
    }
    throw Error("shm backend: " + text);
  };
  if (rank_ == 0) {
    sweep_stale_segments();
    name = new_segment_name();
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) refuse("cannot create shared memory " + name + " in /dev/shm: " + detail::errno_string(errno));
    if (const std::string why = reserve_shm(fd, total_); !why.empty()) {
      close(fd);
      shm_unlink(name.c_str());
      refuse(why);
    }
  }
  try {
    if (rank_ == 0) {
      map(fd, name);
      auto* h = new (base_) Header{};
      h->version = kVersion;
      h->size = static_cast<uint32_t>(n);
      h->round_bytes = round_bytes_;
      h->ring_bytes = ring_bytes_;
      h->total_bytes = total_;
      for (int r = 0; r < n; ++r) new (slot(r)) Slot{};
      for (int s = 0; s < n; ++s)
        for (int d = 0; d < n; ++d) new (ring_of(s, d)) Ring{};
      std::atomic_thread_fence(std::memory_order_release);
      h->magic = kMagic;
      store.set("shm/segment", name);
    } else {
      name = to_string(store.get("shm/segment", ctx.timeout));
      if (name.empty() || name[0] != '/') {
        if (store.add("shm/reason_read", 1) >= n - 1) store.set("shm/reason_heard", "1");
        throw Error("shm backend: rank " + std::to_string(global) + " has no group segment: " +
                    (name.empty() ? std::string("rank 0 gave no name") : name.substr(1)));
      }
      fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
      if (fd < 0) {
        throw Error("shm backend: rank " + std::to_string(global) + " cannot open " + name + ": " +
                    detail::errno_string(errno) + ". Are all ranks of this group on one host? Use the gloo backend across hosts");
      }
      struct stat st;
      if (const std::string why = detail::why_not_private(fd); !why.empty()) {
        close(fd);
        throw Error("shm backend: segment " + name + " " + why +
                    "; a job's shared memory is its user's alone, so this rank refuses to attach");
      }
      if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != total_) {
        close(fd);
        throw Error("shm backend: segment " + name + " has an unexpected size; ranks disagree on the group size or buffer settings (TDIST_SHM_*)");
      }
      map(fd, name);
      if (header()->magic != kMagic || header()->version != kVersion || header()->size != static_cast<uint32_t>(n)) {
        throw Error("shm backend: segment " + name + " was made by another version or group size");
      }
    }
    Slot* me = slot(rank_);
    me->start_time.store(process_start_time(getpid()));
    me->pid.store(getpid());
    if (store.add("shm/attached", 1) == n) store.set("shm/all_attached", "1");
    store.wait({"shm/all_attached"}, ctx.timeout);
    if (rank_ == 0) shm_unlink(name.c_str());
  } catch (...) {
    if (rank_ == 0) shm_unlink(name.c_str());
    if (base_) {  // the destructor does not run for a constructor that throws
      munmap(base_, total_);
      base_ = nullptr;
    }
    throw;
  }
}

void GroupSegment::map(int fd, const std::string& name) {
  void* p = map_and_close(fd, total_);
  if (p == MAP_FAILED) throw Error("shm backend: cannot map " + name + ": " + detail::errno_string(errno));
  base_ = static_cast<uint8_t*>(p);
}

}  // namespace tdist::comm::shm
