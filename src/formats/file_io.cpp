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

// The writing itself is util/write_aside.h's; this says its errors as
// CheckpointErrors.
AtomicFileWriter::AtomicFileWriter(std::string path) : file_(std::move(path), 0600) { check(); }

AtomicFileWriter::~AtomicFileWriter() = default;

void AtomicFileWriter::check() const {
  if (!file_.ok()) throw CheckpointError(file_.error());
}

void AtomicFileWriter::write(const void* data, size_t n) {
  file_.write(data, n);
  check();
}

void AtomicFileWriter::write_at(uint64_t offset, const void* data, size_t n) {
  file_.write_at(offset, data, n);
  check();
}

void AtomicFileWriter::sync() {
  file_.sync();
  check();
}

void AtomicFileWriter::commit() {
  file_.commit(/*durable=*/true);
  check();
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
