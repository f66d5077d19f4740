// Files of checkpoints: written so that a crash never leaves a half-written
// file where the previous one stood, and read with every length checked.
//
// AtomicFileWriter writes "<path>.tmp-<pid>-<n>" (a new file, created
// exclusively) in the same directory; commit() fsyncs it, renames it over
// `path` and fsyncs the directory, so `path` is always the old file or the
// whole new one (util/write_aside.h's AsideFile, durable). sync() alone does the fsync (a caller that renames several
// files together syncs them all first). Destroyed without commit(), it
// removes the temporary file; a process killed while writing leaves it
// behind (never under the final name).
// FileReader reads exact byte ranges; a range past the end of the file is
// a CheckpointError naming the file ("truncated?"), never a short read.
// CRC-32 (zip's and zlib's; computed by ISA-L where it is built in, else
// zlib) is what checkpoints carry to catch corrupted bytes.
//
// Errors: CheckpointError naming the file and the system's reason.
// Threading: one thread per object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "util/write_aside.h"

namespace tdist::checkpoint {

class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Appends n bytes.
  void write(const void* data, size_t n);
  // Overwrites n bytes at `offset` (which must lie within what was written).
  void write_at(uint64_t offset, const void* data, size_t n);
  uint64_t size() const { return file_.size(); }
  // fsync, rename over the path, fsync the directory.
  void sync();
  void commit();
  const std::string& path() const { return file_.path(); }

 private:
  detail::AsideFile file_;
  void check() const;
};

class FileReader {
 public:
  explicit FileReader(std::string path);
  // A window of the file: bytes [base, base + length), read as a file of
  // `length` bytes (a DCP item inside its rank's file); CheckpointError
  // when the file is shorter. path() names the file and the window.
  FileReader(const std::string& path, uint64_t base, uint64_t length);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  uint64_t size() const { return size_; }
  // Reads exactly n bytes at offset.
  void read_at(uint64_t offset, void* out, size_t n) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint64_t base_ = 0;
};

// The directory part of a path: "." without a '/', "/" for "/x".
std::string directory_of(const std::string& path);
// The part after the last '/' (all of it without one).
std::string name_of(const std::string& path);
// The path with its directory resolved (realpath: links, ".", ".."
// followed) and its last part kept as it is, so that two spellings of one
// place compare equal whether or not the file exists yet; unchanged when
// the directory cannot be resolved (it does not exist).
std::string resolve_directory(const std::string& path);

// CRC-32 of n bytes, continuing from `crc` (0 to start).
uint32_t crc32(uint32_t crc, const void* data, size_t n);

}  // namespace tdist::checkpoint
