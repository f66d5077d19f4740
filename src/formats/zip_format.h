// The zip archive under .pt files: stored (uncompressed) records whose
// data begins at a multiple of 64 bytes (padding in the local header's
// extra field, as PyTorch writes it), a central directory, and the zip64
// records when an offset, a size or the count does not fit the classic
// fields. zip_writer.cpp makes the bytes of headers and directories;
// zip_reader.cpp parses and checks a directory. No LibTorch here (the
// fuzzer builds this alone), and no file: the reader reads through a
// callback, so that it also runs over bytes in memory.
//
// Errors: CheckpointError without the file's name (the caller adds it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tdist::checkpoint::zip {

constexpr uint64_t kAlignment = 64;     // of each record's data
constexpr uint64_t kLocalCrcField = 14;  // the CRC-32's offset in a local header
constexpr uint64_t kMax32 = 0xffffffffu;

struct Entry {
  std::string name;           // the full record name, "archive/data/0"
  uint64_t header_offset = 0;  // of its local header
  uint64_t data_offset = 0;    // of its first byte of data
  uint64_t size = 0;
  uint32_t crc = 0;
};

// The local header of a stored record of `size` bytes whose header begins
// at `offset`, padded so that its data begins at a multiple of kAlignment.
// zip64: give the sizes in a zip64 extra field (needed when size >= kMax32).
std::string local_header(const std::string& name, uint64_t offset, uint64_t size, uint32_t crc, bool zip64);

// The central directory of `entries` and the end records, to be written at
// `offset`; zip64 records wherever a field does not fit, or everywhere
// when force_zip64.
std::string central_directory(const std::vector<Entry>& entries, uint64_t offset, bool force_zip64);

// Tests only: makes writers of .pt files use zip64 fields for every
// record (they otherwise do only past 4 GiB).
void set_force_zip64_for_testing(bool on);
bool force_zip64_for_testing();

// Reads n bytes at offset; only called for ranges within the file size.
using ReadAt = std::function<void(uint64_t offset, void* out, size_t n)>;

// The records of a zip file of file_size bytes, in the directory's order,
// every offset and size checked against the file: the end record (zip64
// too), the directory, each local header (its name must match), each
// record's data before the directory and overlapping no other record;
// stored records only, no encryption, no two of one name.
std::vector<Entry> read_directory(const ReadAt& read, uint64_t file_size);

// The one top folder all records lie under ("archive" for
// "archive/data.pkl"); every record must be "<folder>/<something>".
std::string archive_of(const std::vector<Entry>& entries);

}  // namespace tdist::checkpoint::zip
