// FileStore: an append-only log of records in one file.
//
//   file    := magic record*
//   magic   := "TDISTFS1"
//   record  := op:u8 key_len:u32le key value_len:u32le value
//   op      := 1 set | 2 delete | 3 users (value = int64le delta; key empty)
//
// Every operation takes the process-local mutex, then an exclusive flock on
// the file, replays the records it has not seen into a local map, acts, and
// appends its own records. Holding the flock makes the whole step atomic
// across processes.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "store/kv.h"
#include "tdist/store.h"
#include "util/env.h"
#include "util/open_file.h"
#include "util/coding.h"

namespace tdist {

namespace {

constexpr char kMagic[8] = {'T', 'D', 'I', 'S', 'T', 'F', 'S', '1'};
constexpr uint8_t kOpSet = 1;
constexpr uint8_t kOpDelete = 2;
constexpr uint8_t kOpUsers = 3;

void put_u32(std::string& out, uint32_t v) { coding::put_fixed32(out, v); }

uint32_t get_u32(const uint8_t* p) { return coding::decode_fixed32(p); }

std::string encode_record(uint8_t op, const std::string& key, const Bytes& value) {
  if (key.size() > UINT32_MAX || value.size() > UINT32_MAX) {
    throw UsageError("FileStore: keys and values must be smaller than 4 GiB");
  }
  std::string out;
  out.reserve(9 + key.size() + value.size());
  out.push_back(static_cast<char>(op));
  put_u32(out, static_cast<uint32_t>(key.size()));
  out += key;
  put_u32(out, static_cast<uint32_t>(value.size()));
  out.append(value.begin(), value.end());
  return out;
}

Bytes encode_delta(int64_t delta) {
  Bytes b(8);
  coding::encode_le(reinterpret_cast<char*>(b.data()), static_cast<uint64_t>(delta), 8);
  return b;
}

int64_t decode_delta(const uint8_t* p) {
  return static_cast<int64_t>(coding::decode_fixed64(p));
}

}  // namespace

struct FileStore::State {
  std::string path;
  int fd = -1;
  std::mutex mu;       // threads of this process; flock alone is per open file
  uint64_t offset = 0; // bytes of the file already replayed into map
  detail::KeyValueMap map;
  int64_t users = 0;   // live FileStore objects on this file, all processes
  Milliseconds lock_timeout;

  [[noreturn]] void fail(const std::string& what, int err) const {
    throw StoreError("FileStore '" + path + "': " + what + ": " + detail::errno_string(err));
  }

  // An exclusive flock, retried until lock_timeout: a process stopped while
  // holding the lock must not hang everyone silently.
  void lock_file() {
    const auto deadline = std::chrono::steady_clock::now() + lock_timeout;
    auto pause = std::chrono::microseconds(50);
    while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) fail("flock", errno);
      if (std::chrono::steady_clock::now() >= deadline) {
        throw TimeoutError("FileStore '" + path + "': could not lock the file within " +
                           detail::format_duration_ms(lock_timeout.count()) +
                           "; another process holds it (stopped or stuck?)");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(5000));
    }
  }
  void unlock_file() { flock(fd, LOCK_UN); }

  // Replays every record after offset. Called with the flock held, so a
  // partial record can only come from a writer that died mid-write or from
  // outside damage: both are corruption.
  void refresh() {
    struct stat st;
    if (fstat(fd, &st) != 0) fail("fstat", errno);
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size < offset) {
      throw StoreError("FileStore '" + path + "': the file shrank from " + std::to_string(offset) +
                       " to " + std::to_string(size) + " bytes; it was truncated or replaced while in use");
    }
    if (size == offset) return;
    std::vector<uint8_t> buf(size - offset);
    size_t got = 0;
    while (got < buf.size()) {
      ssize_t n = pread(fd, buf.data() + got, buf.size() - got, static_cast<off_t>(offset + got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("read", errno);
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    if (got != buf.size()) fail("short read", EIO);
    size_t pos = 0;
    if (offset == 0) {
      if (buf.size() < sizeof kMagic || std::memcmp(buf.data(), kMagic, sizeof kMagic) != 0) {
        throw StoreError("FileStore '" + path + "': not a tdist FileStore file (bad header)");
      }
      pos = sizeof kMagic;
    }
    while (pos < buf.size()) {
      const uint64_t at = offset + pos;
      auto corrupt = [&](const char* why) {
        throw StoreError("FileStore '" + path + "': corrupt record at offset " + std::to_string(at) +
                         " (" + why + "); delete the file to start over");
      };
      if (buf.size() - pos < 5) corrupt("truncated header");
      const uint8_t op = buf[pos];
      const uint32_t klen = get_u32(&buf[pos + 1]);
      if (buf.size() - pos - 5 < klen + uint64_t(4)) corrupt("truncated key");
      std::string key(reinterpret_cast<const char*>(&buf[pos + 5]), klen);
      const size_t vpos = pos + 5 + klen;
      const uint32_t vlen = get_u32(&buf[vpos]);
      if (buf.size() - vpos - 4 < vlen) corrupt("truncated value");
      const uint8_t* v = &buf[vpos + 4];
      switch (op) {
        case kOpSet: map.set(key, Bytes(v, v + vlen)); break;
        case kOpDelete: map.erase(key); break;
        case kOpUsers:
          if (vlen != 8) corrupt("bad users record");
          users += decode_delta(v);
          break;
        default: corrupt("unknown record type");
      }
      pos = vpos + 4 + vlen;
    }
    offset = size;
  }

  void append(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n = pwrite(fd, bytes.data() + done, bytes.size() - done,
                         static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("write", errno);
      done += static_cast<size_t>(n);
    }
    offset += bytes.size();
  }

  // Runs fn with both locks held and the map up to date.
  template <typename Fn>
  auto locked(Fn&& fn) {
    std::lock_guard<std::mutex> guard(mu);
    lock_file();
    struct Unlock {
      State* s;
      ~Unlock() { s->unlock_file(); }
    } unlock{this};
    refresh();
    return fn();
  }
};

FileStore::FileStore(std::string path, Milliseconds timeout)
    : Store(timeout), state_(std::make_unique<State>()) {
  if (path.empty()) throw UsageError("FileStore: the path must not be empty");
  state_->path = std::move(path);
  state_->lock_timeout = timeout;
  // The last user of a file unlinks it. If that happens between our open and
  // our lock, we hold a dead inode: reopen until the locked file is the one
  // the path names.
  for (;;) {
    // Private to this user: the file holds the job's rendezvous.
    // Never blocking on a FIFO or device put at the path: refused, named.
    std::string error;
    int fd = detail::open_regular(state_->path, O_RDWR | O_CREAT | O_NOFOLLOW, error, 0600);
    if (fd < 0) throw StoreError("FileStore: " + error);
    struct stat owner;
    if (fstat(fd, &owner) == 0) {
      if (owner.st_uid != geteuid()) {
        close(fd);
        throw StoreError("FileStore: '" + state_->path + "' belongs to uid " + std::to_string(owner.st_uid) +
                         ", not to this user; refusing a store someone else can write. Use a path of your own");
      }
      if (owner.st_mode & 077) fchmod(fd, 0600);  // left by an older tdist
    }
    state_->fd = fd;
    state_->lock_file();
    struct stat by_fd, by_path;
    if (fstat(fd, &by_fd) == 0 && stat(state_->path.c_str(), &by_path) == 0 &&
        by_fd.st_ino == by_path.st_ino && by_fd.st_dev == by_path.st_dev) {
      break;
    }
    state_->unlock_file();
    close(fd);
    state_->fd = -1;
  }
  try {
    struct stat st;
    if (fstat(state_->fd, &st) != 0) state_->fail("fstat", errno);
    if (st.st_size == 0) {
      state_->append(std::string(kMagic, sizeof kMagic));
    }
    state_->refresh();
    state_->append(encode_record(kOpUsers, "", encode_delta(+1)));
    state_->users += 1;
  } catch (...) {
    state_->unlock_file();
    close(state_->fd);
    throw;
  }
  state_->unlock_file();
}

FileStore::~FileStore() {
  try {
    state_->locked([&] {
      state_->append(encode_record(kOpUsers, "", encode_delta(-1)));
      state_->users -= 1;
      if (state_->users <= 0) unlink(state_->path.c_str());
      return 0;
    });
  } catch (const std::exception&) {
    // A destructor must not throw; the file stays behind for inspection.
  }
  close(state_->fd);
}

const std::string& FileStore::path() const { return state_->path; }

void FileStore::do_set(const std::string& key, const Bytes& value) {
  state_->locked([&] {
    state_->append(encode_record(kOpSet, key, value));
    state_->map.set(key, value);
    return 0;
  });
}

std::vector<Bytes> FileStore::do_get(const std::vector<std::string>& keys, Milliseconds timeout) {
  do_wait(keys, timeout);
  // Keys may be deleted between the wait and this read; wait again if so.
  for (;;) {
    auto result = state_->locked([&]() -> std::optional<std::vector<Bytes>> {
      if (!state_->map.contains_all(keys)) return std::nullopt;
      return state_->map.values(keys);
    });
    if (result) return std::move(*result);
    do_wait(keys, timeout);
  }
}

int64_t FileStore::do_add(const std::string& key, int64_t delta) {
  return state_->locked([&] {
    detail::KeyValueMap scratch;
    if (const Bytes* old = state_->map.find(key)) scratch.set(key, *old);
    const int64_t next = scratch.add(key, delta);
    const Bytes& value = *scratch.find(key);
    state_->append(encode_record(kOpSet, key, value));
    state_->map.set(key, value);
    return next;
  });
}

Bytes FileStore::do_compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return state_->locked([&] {
    const Bytes* old = state_->map.find(key);
    const bool matches = old ? *old == expected : expected.empty();
    if (!matches) return old ? *old : Bytes{};
    state_->append(encode_record(kOpSet, key, desired));
    state_->map.set(key, desired);
    return desired;
  });
}

void FileStore::do_wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  auto pause = std::chrono::microseconds(100);
  for (;;) {
    auto missing = state_->locked([&] { return state_->map.missing(keys); });
    if (missing.empty()) return;
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited >= timeout) {
      throw TimeoutError(detail::store_timeout_message(
          "FileStore", keys.size() == 1 ? "get" : "wait", missing, timeout.count()));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
}

bool FileStore::do_check(const std::vector<std::string>& keys) {
  return state_->locked([&] { return state_->map.contains_all(keys); });
}

bool FileStore::do_delete_key(const std::string& key) {
  return state_->locked([&] {
    if (!state_->map.find(key)) return false;
    state_->append(encode_record(kOpDelete, key, {}));
    state_->map.erase(key);
    return true;
  });
}

int64_t FileStore::do_num_keys() {
  return state_->locked([&] { return static_cast<int64_t>(state_->map.size()); });
}

void FileStore::do_multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  state_->locked([&] {
    std::string records;
    for (size_t i = 0; i < keys.size(); ++i) records += encode_record(kOpSet, keys[i], values[i]);
    state_->append(records);
    for (size_t i = 0; i < keys.size(); ++i) state_->map.set(keys[i], values[i]);
    return 0;
  });
}

}  // namespace tdist
