// Parsing and checking a zip archive's directory: the end record (and the
// zip64 locator and record), the central directory, each local header.
// Every offset and length is checked against the file's size before it is
// read or allocated from. The contract is in zip_format.h.
#include <algorithm>
#include <cstring>

#include "formats/zip_format.h"
#include "tdist/errors.h"
#include "util/coding.h"

namespace tdist::checkpoint::zip {

namespace {

constexpr uint64_t kEndSize = 22, kLocatorSize = 20, kEnd64Size = 56;
constexpr uint64_t kCentralSize = 46, kLocalSize = 30;
constexpr uint64_t kMaxComment = 0xffff;
constexpr uint64_t kMaxDirectory = uint64_t{256} << 20;

[[noreturn]] void fail(const std::string& what) { throw CheckpointError("zip: " + what); }

uint64_t get(const uint8_t* p, int bytes) { return coding::decode_le(p, bytes); }

// Whether [offset, offset + n) lies within [0, limit).
bool within(uint64_t offset, uint64_t n, uint64_t limit) { return offset <= limit && n <= limit - offset; }

struct End {
  uint64_t count = 0, cd_size = 0, cd_offset = 0;
  uint64_t cd_limit = 0;  // where the directory must end: the zip64 record or the end record
};

End read_end(const ReadAt& read, uint64_t file_size) {
  if (file_size < kEndSize) fail("the file is " + std::to_string(file_size) + " bytes, too short for a zip archive");
  const uint64_t tail_size = std::min(file_size, kEndSize + kMaxComment);
  std::vector<uint8_t> tail(static_cast<size_t>(tail_size));
  read(file_size - tail_size, tail.data(), tail.size());
  // The last end record whose comment reaches exactly to the end of the file.
  uint64_t at = tail_size - kEndSize + 1;
  const uint8_t* e = nullptr;
  while (at-- > 0) {
    const uint8_t* p = tail.data() + at;
    if (get(p, 4) == 0x06054b50 && at + kEndSize + get(p + 20, 2) == tail_size) {
      e = p;
      break;
    }
  }
  if (e == nullptr) fail("no end of central directory record (not a zip archive, or truncated)");
  const uint64_t end_at = file_size - tail_size + at;
  if (get(e + 4, 2) != 0 || get(e + 6, 2) != 0) fail("a multi-disk archive");
  End r;
  r.count = get(e + 10, 2);
  r.cd_size = get(e + 12, 4);
  r.cd_offset = get(e + 16, 4);
  r.cd_limit = end_at;
  uint8_t loc[kLocatorSize];
  if (end_at >= kLocatorSize) {
    read(end_at - kLocatorSize, loc, sizeof loc);
    if (get(loc, 4) == 0x07064b50) {
      const uint64_t rec_at = get(loc + 8, 8);
      if (get(loc + 4, 4) != 0 || get(loc + 16, 4) > 1) fail("a multi-disk zip64 archive");
      if (!within(rec_at, kEnd64Size, end_at - kLocatorSize)) fail("the zip64 end record lies outside the file");
      uint8_t z[kEnd64Size];
      read(rec_at, z, sizeof z);
      if (get(z, 4) != 0x06064b50) fail("no zip64 end record where the locator points");
      if (get(z + 16, 4) != 0 || get(z + 20, 4) != 0) fail("a multi-disk zip64 archive");
      r.count = get(z + 32, 8);
      if (get(z + 24, 8) != r.count) fail("the zip64 end record's two entry counts differ");
      r.cd_size = get(z + 40, 8);
      r.cd_offset = get(z + 48, 8);
      r.cd_limit = rec_at;
      return r;
    }
  }
  if (r.count == 0xffff || r.cd_size == kMax32 || r.cd_offset == kMax32) {
    fail("the end record defers to zip64 fields, but there is no zip64 locator");
  }
  if (get(e + 8, 2) != r.count) fail("the end record's two entry counts differ");
  return r;
}

// The zip64 extra field's values for the fields that are 0xffffffff.
void read_zip64_extra(const uint8_t* extra, uint64_t n, uint64_t* size, uint64_t* comp, uint64_t* offset,
                      const std::string& name) {
  const bool want_size = *size == kMax32, want_comp = *comp == kMax32, want_offset = offset && *offset == kMax32;
  if (!want_size && !want_comp && !want_offset) return;
  uint64_t at = 0;
  while (at + 4 <= n) {
    const uint64_t tag = get(extra + at, 2), len = get(extra + at + 2, 2);
    if (len > n - at - 4) fail("record '" + name + "': an extra field runs past its end");
    if (tag == 0x0001) {
      const uint8_t* p = extra + at + 4;
      uint64_t used = 0;
      const auto take = [&](uint64_t* v) {
        if (used + 8 > len) fail("record '" + name + "': its zip64 field is too short");
        *v = get(p + used, 8);
        used += 8;
      };
      if (want_size) take(size);
      if (want_comp) take(comp);
      if (want_offset) take(offset);
      return;
    }
    at += 4 + len;
  }
  fail("record '" + name + "': 0xffffffff fields without a zip64 extra field");
}

}  // namespace

std::vector<Entry> read_directory(const ReadAt& read_at, uint64_t file_size) {
  const auto read = [&read_at](uint64_t offset, void* out, size_t n) {
    if (n > 0) read_at(offset, out, n);
  };
  const End end = read_end(read, file_size);
  if (!within(end.cd_offset, end.cd_size, end.cd_limit)) {
    fail("the central directory ([" + std::to_string(end.cd_offset) + ", +" + std::to_string(end.cd_size) +
         ")) lies outside the file (truncated?)");
  }
  if (end.cd_size > kMaxDirectory) fail("a central directory of more than 256 MiB");
  if (end.count > end.cd_size / kCentralSize) {
    fail(std::to_string(end.count) + " entries cannot fit a central directory of " + std::to_string(end.cd_size) +
         " bytes");
  }
  std::vector<uint8_t> cd(static_cast<size_t>(end.cd_size));
  read(end.cd_offset, cd.data(), cd.size());
  std::vector<Entry> entries;
  entries.reserve(static_cast<size_t>(end.count));
  uint64_t at = 0;
  for (uint64_t k = 0; k < end.count; ++k) {
    if (!within(at, kCentralSize, cd.size())) fail("the central directory ends inside entry " + std::to_string(k));
    const uint8_t* p = cd.data() + at;
    if (get(p, 4) != 0x02014b50) fail("central directory entry " + std::to_string(k) + " has no signature");
    const uint64_t name_len = get(p + 28, 2), extra_len = get(p + 30, 2), comment_len = get(p + 32, 2);
    if (!within(at + kCentralSize, name_len + extra_len + comment_len, cd.size())) {
      fail("central directory entry " + std::to_string(k) + " runs past the directory");
    }
    Entry e;
    e.name.assign(reinterpret_cast<const char*>(p + kCentralSize), static_cast<size_t>(name_len));
    if (e.name.empty()) fail("central directory entry " + std::to_string(k) + " has no name");
    const uint64_t flags = get(p + 8, 2), method = get(p + 10, 2);
    if (flags & 0x41) fail("record '" + e.name + "' is encrypted");
    if (method != 0) fail("record '" + e.name + "' is compressed (method " + std::to_string(method) + "), not stored");
    if (get(p + 34, 2) != 0 && get(p + 34, 2) != 0xffff) fail("record '" + e.name + "' is on another disk");
    e.crc = static_cast<uint32_t>(get(p + 16, 4));
    uint64_t comp = get(p + 20, 4);
    e.size = get(p + 24, 4);
    e.header_offset = get(p + 42, 4);
    read_zip64_extra(p + kCentralSize + name_len, extra_len, &e.size, &comp, &e.header_offset, e.name);
    if (comp != e.size) fail("record '" + e.name + "': its compressed and stored sizes differ");
    entries.push_back(std::move(e));
    at += kCentralSize + name_len + extra_len + comment_len;
  }
  // Two records of one name: one sort (memory: a pointer per record, not
  // a second copy of every name).
  std::vector<const Entry*> by_name;
  by_name.reserve(entries.size());
  for (const Entry& e : entries) by_name.push_back(&e);
  std::sort(by_name.begin(), by_name.end(), [](const Entry* a, const Entry* b) { return a->name < b->name; });
  for (size_t i = 1; i < by_name.size(); ++i) {
    if (by_name[i]->name == by_name[i - 1]->name) fail("two records are named '" + by_name[i]->name + "'");
  }
  // Each local header: within the data before the directory, of the same name.
  for (Entry& e : entries) {
    uint8_t h[kLocalSize];
    if (!within(e.header_offset, kLocalSize, end.cd_offset)) fail("record '" + e.name + "': its local header lies past the data");
    read(e.header_offset, h, sizeof h);
    if (get(h, 4) != 0x04034b50) fail("record '" + e.name + "': no local header where the directory points");
    if (get(h + 8, 2) != 0) fail("record '" + e.name + "': its local header says it is compressed");
    const uint64_t name_len = get(h + 26, 2), extra_len = get(h + 28, 2);
    if (name_len != e.name.size() || !within(e.header_offset + kLocalSize, name_len + extra_len, end.cd_offset)) {
      fail("record '" + e.name + "': its local header does not match the directory");
    }
    std::string name(static_cast<size_t>(name_len), '\0');
    read(e.header_offset + kLocalSize, name.data(), name.size());
    if (name != e.name) fail("record '" + e.name + "': its local header names '" + name + "'");
    e.data_offset = e.header_offset + kLocalSize + name_len + extra_len;
    if (!within(e.data_offset, e.size, end.cd_offset)) {
      fail("record '" + e.name + "': its " + std::to_string(e.size) + " bytes run past the data (truncated?)");
    }
  }
  std::vector<const Entry*>& by_offset = by_name;  // the same pointers, sorted again
  std::sort(by_offset.begin(), by_offset.end(),
            [](const Entry* a, const Entry* b) { return a->header_offset < b->header_offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i - 1]->data_offset + by_offset[i - 1]->size > by_offset[i]->header_offset) {
      fail("records '" + by_offset[i - 1]->name + "' and '" + by_offset[i]->name + "' overlap");
    }
  }
  return entries;
}

std::string archive_of(const std::vector<Entry>& entries) {
  if (entries.empty()) fail("an archive of no records");
  const size_t slash = entries[0].name.find('/');
  if (slash == std::string::npos || slash == 0) fail("record '" + entries[0].name + "' is not in a folder");
  const std::string archive = entries[0].name.substr(0, slash);
  for (const Entry& e : entries) {
    if (e.name.size() <= slash + 1 || e.name.compare(0, slash + 1, archive + "/") != 0) {
      fail("record '" + e.name + "' is not in the folder '" + archive + "' of the others");
    }
  }
  return archive;
}

}  // namespace tdist::checkpoint::zip
