// Checkpoint files: the atomic writer, the checked reader, CRC-32. The
// contract is in file_io.h.
#include "formats/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#if TDIST_HAVE_ISAL
#include <isa-l/crc.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "tdist/errors.h"
#include "util/open_file.h"

namespace tdist::checkpoint {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw CheckpointError(path + ": " + what + (errno ? std::string(" (") + std::strerror(errno) + ")" : ""));
}

}  // namespace

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string name_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string resolve_directory(const std::string& path) {
  char* dir = ::realpath(directory_of(path).c_str(), nullptr);
  if (!dir) return path;
  std::string out = dir;
  std::free(dir);
  return (out == "/" ? out : out + "/") + name_of(path);
}

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  static std::atomic<uint64_t> counter{0};
  tmp_ = path_ + ".tmp-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  errno = 0;
  // A name of its own: never an existing file, never through a link.
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd_ < 0) fail(path_, "cannot create " + tmp_);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFileWriter::write(const void* data, size_t n) {
  write_at(size_, data, n);
}

void AtomicFileWriter::write_at(uint64_t offset, const void* data, size_t n) {
  if (offset > size_) fail(path_, "write past the end of what was written");
  const char* p = static_cast<const char*>(data);
  uint64_t at = offset;
  while (n > 0) {
    errno = 0;
    const ssize_t w = ::pwrite(fd_, p, std::min<size_t>(n, 1 << 30), static_cast<off_t>(at));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail(path_, "write failed");
    p += w;
    at += static_cast<uint64_t>(w);
    n -= static_cast<size_t>(w);
  }
  size_ = std::max(size_, at);
}

void AtomicFileWriter::sync() {
  if (synced_) return;
  errno = 0;
  if (::fsync(fd_) != 0) fail(path_, "fsync failed");
  synced_ = true;
}

void AtomicFileWriter::commit() {
  sync();
  errno = 0;
  if (::close(fd_) != 0) {
    fd_ = -1;
    fail(path_, "close failed");
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail(path_, "cannot rename " + tmp_ + " over it");
  committed_ = true;
  const int dir = ::open(directory_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {  // the rename itself is durable once the directory is
    ::fsync(dir);
    ::close(dir);
  }
}

FileReader::FileReader(std::string path) : path_(std::move(path)) {
  // Never blocks on a FIFO or device named like a checkpoint file: those
  // are refused, their type named.
  struct stat st {};
  fd_ = tdist::detail::open_regular_or_throw<CheckpointError>(path_, O_RDONLY, 0, &st);
  size_ = static_cast<uint64_t>(st.st_size);
}

FileReader::FileReader(const std::string& path, uint64_t base, uint64_t length) : FileReader(path) {
  if (base > size_ || length > size_ - base) {
    errno = 0;
    fail(path_, "wants bytes [" + std::to_string(base) + ", +" + std::to_string(length) + ") of a " +
                    std::to_string(size_) + "-byte file (truncated?)");
  }
  base_ = base;
  size_ = length;
  path_ += " (bytes " + std::to_string(base) + " to " + std::to_string(base + length) + ")";
}

FileReader::~FileReader() {
  if (fd_ >= 0) ::close(fd_);
}

void FileReader::read_at(uint64_t offset, void* out, size_t n) const {
  if (offset > size_ || n > size_ - offset) {
    errno = 0;
    fail(path_, "wants bytes [" + std::to_string(offset) + ", " + std::to_string(offset + n) + ") of a " +
                    std::to_string(size_) + "-byte file (truncated?)");
  }
  char* p = static_cast<char*>(out);
  while (n > 0) {
    errno = 0;
    const ssize_t r = ::pread(fd_, p, std::min<size_t>(n, 1 << 30), static_cast<off_t>(base_ + offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) fail(path_, "read failed (truncated while open?)");
    p += r;
    offset += static_cast<uint64_t>(r);
    n -= static_cast<size_t>(r);
  }
}

uint32_t crc32(uint32_t crc, const void* data, size_t n) {
#if TDIST_HAVE_ISAL
  // The same CRC (gzip's, reflected), folded with carry-less multiplies:
  // ~2.5x zlib's speed, which checkpoints spend most of their CPU on.
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
#else
  const Bytef* p = static_cast<const Bytef*>(data);
  uLong c = crc;
  while (n > 0) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(n, UINT_MAX));
    c = ::crc32(c, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<uint32_t>(c);
#endif
}

}  // namespace tdist::checkpoint
