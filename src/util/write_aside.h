// Writing a whole file where readers may look at any moment, crash-safe:
// the one place tdist does "write aside, (fsync,) rename". The bytes go to
// a temporary of its own beside the file ("PATH.tmp-<pid>-<n>", created
// exclusively, never through a link), which commit() renames over PATH:
// a reader sees the old file or the whole new one, never a part. durable:
// fsync before the rename and the directory after, so that the new file
// also survives a power cut (checkpoints, the Checkpointer's marker; a
// trace dump need not). An AsideFile destroyed before commit() removes its
// temporary (a process killed while writing leaves it, never under PATH).
//
// Errors: every call says whether it worked; error() then names the path,
// what failed and the system's reason. Header-only and LibTorch-free: the
// formats, the trace files and the tools use it without a library.
// Threading: one thread per object.
#pragma once

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

namespace tdist::detail {

class AsideFile {
 public:
  explicit AsideFile(std::string path, mode_t mode = 0644) : path_(std::move(path)) {
    static std::atomic<uint64_t> counter{0};
    tmp_ = path_ + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd_ < 0) fail("cannot create " + tmp_);
  }
  ~AsideFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  AsideFile(const AsideFile&) = delete;
  AsideFile& operator=(const AsideFile&) = delete;

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  const std::string& path() const { return path_; }
  const std::string& temporary() const { return tmp_; }
  uint64_t size() const { return size_; }

  // Appends n bytes.
  bool write(const void* data, size_t n) { return write_at(size_, data, n); }
  // Overwrites n bytes at `offset`, within what was written (or appends at its end).
  bool write_at(uint64_t offset, const void* data, size_t n) {
    if (!ok()) return false;
    if (offset > size_) return fail("a write past the end of what was written", 0);
    const char* p = static_cast<const char*>(data);
    uint64_t at = offset;
    while (n > 0) {
      const ssize_t w = ::pwrite(fd_, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(at));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return fail("write failed", w < 0 ? errno : EIO);
      p += w;
      at += static_cast<uint64_t>(w);
      n -= static_cast<size_t>(w);
    }
    size_ = std::max(size_, at);
    return true;
  }
  // fsync of what was written (a caller that renames several files
  // together syncs them all first).
  bool sync() {
    if (!ok()) return false;
    if (!synced_ && ::fsync(fd_) != 0) return fail("fsync failed", errno);
    synced_ = true;
    return true;
  }
  // Renames the temporary over the path (durable: fsync first, and the
  // directory after).
  bool commit(bool durable) {
    if (!ok() || (durable && !sync())) return false;
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return fail("close failed", errno);
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) return fail("cannot rename " + tmp_ + " over it", errno);
    committed_ = true;
    if (durable) {  // the rename itself is durable once the directory is
      const size_t slash = path_.rfind('/');
      const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path_.substr(0, slash);
      const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (d >= 0) {
        (void)::fsync(d);
        ::close(d);
      }
    }
    return true;
  }

 private:
  std::string path_, tmp_, error_;
  int fd_ = -1;
  uint64_t size_ = 0;
  bool synced_ = false, committed_ = false;

  bool fail(const std::string& what, int err = errno) {
    error_ = path_ + ": " + what + (err ? std::string(" (") + std::strerror(err) + ")" : std::string());
    return false;
  }
};

// `text` as the whole of `path`, written aside; false with `error` set
// (and no temporary left) when it could not be.
inline bool write_aside(const std::string& path, const std::string& text, std::string& error, bool durable = false,
                        mode_t mode = 0644) {
  AsideFile f(path, mode);
  if (!f.write(text.data(), text.size()) || !f.commit(durable)) {
    error = f.error();
    return false;
  }
  return true;
}

}  // namespace tdist::detail
