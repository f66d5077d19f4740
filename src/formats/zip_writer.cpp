// The bytes of a zip archive's local headers (64-byte aligned data) and its
// central directory with the end records, zip64 where needed (APPNOTE.TXT
// 4.3.7, 4.3.12, 4.3.14-16, 4.5.3). The contract is in zip_format.h.
#include <atomic>

#include "formats/zip_format.h"
#include "tdist/errors.h"
#include "util/coding.h"

namespace tdist::checkpoint::zip {

namespace {

std::atomic<bool> g_force_zip64{false};

constexpr uint16_t kNeeded = 20, kNeeded64 = 45;
constexpr uint16_t kMadeBy = (3 << 8) | 45;  // Unix, 4.5
constexpr uint16_t kDate = (1 << 5) | 1;     // 1980-01-01, 00:00
constexpr uint16_t kZip64Tag = 0x0001, kPadTag = 0x4246;  // "FB", as PyTorch's padding

void put(std::string& out, uint64_t v, int bytes) { coding::put_le(out, v, bytes); }

void check_name(const std::string& name) {
  if (name.empty() || name.size() > 0xffff) throw CheckpointError("zip: a record name of " + std::to_string(name.size()) + " bytes");
}

}  // namespace

void set_force_zip64_for_testing(bool on) { g_force_zip64 = on; }
bool force_zip64_for_testing() { return g_force_zip64; }

std::string local_header(const std::string& name, uint64_t offset, uint64_t size, uint32_t crc, bool zip64) {
  check_name(name);
  zip64 = zip64 || size >= kMax32;
  std::string h;
  put(h, 0x04034b50, 4);
  put(h, zip64 ? kNeeded64 : kNeeded, 2);
  put(h, 0, 2);  // flags
  put(h, 0, 2);  // stored
  put(h, 0, 2);  // time
  put(h, kDate, 2);
  put(h, crc, 4);
  put(h, zip64 ? kMax32 : size, 4);  // compressed
  put(h, zip64 ? kMax32 : size, 4);  // uncompressed
  put(h, name.size(), 2);
  const size_t extra_len_at = h.size();
  put(h, 0, 2);  // extra length, below
  h += name;
  const size_t extra_at = h.size();
  if (zip64) {
    put(h, kZip64Tag, 2);
    put(h, 16, 2);
    put(h, size, 8);
    put(h, size, 8);
  }
  const uint64_t end = offset + h.size();
  if (end % kAlignment != 0) {
    const uint64_t pad = (kAlignment - (end + 4) % kAlignment) % kAlignment;
    put(h, kPadTag, 2);
    put(h, pad, 2);
    h.append(static_cast<size_t>(pad), 'Z');
  }
  const size_t extra = h.size() - extra_at;
  coding::encode_le(&h[extra_len_at], extra, 2);
  return h;
}

std::string central_directory(const std::vector<Entry>& entries, uint64_t offset, bool force_zip64) {
  std::string d;
  for (const Entry& e : entries) {
    check_name(e.name);
    const bool big_size = force_zip64 || e.size >= kMax32;
    const bool big_offset = force_zip64 || e.header_offset >= kMax32;
    std::string extra;
    if (big_size) {
      put(extra, e.size, 8);  // uncompressed
      put(extra, e.size, 8);  // compressed
    }
    if (big_offset) put(extra, e.header_offset, 8);
    const bool zip64 = !extra.empty();
    put(d, 0x02014b50, 4);
    put(d, kMadeBy, 2);
    put(d, zip64 ? kNeeded64 : kNeeded, 2);
    put(d, 0, 2);  // flags
    put(d, 0, 2);  // stored
    put(d, 0, 2);  // time
    put(d, kDate, 2);
    put(d, e.crc, 4);
    put(d, big_size ? kMax32 : e.size, 4);
    put(d, big_size ? kMax32 : e.size, 4);
    put(d, e.name.size(), 2);
    put(d, zip64 ? extra.size() + 4 : 0, 2);
    put(d, 0, 2);  // comment
    put(d, 0, 2);  // disk
    put(d, 0, 2);  // internal attributes
    put(d, 0, 4);  // external attributes
    put(d, big_offset ? kMax32 : e.header_offset, 4);
    d += e.name;
    if (zip64) {
      put(d, kZip64Tag, 2);
      put(d, extra.size(), 2);
      d += extra;
    }
  }
  const uint64_t cd_size = d.size(), count = entries.size();
  const bool zip64 = force_zip64 || count >= 0xffff || cd_size >= kMax32 || offset >= kMax32;
  if (zip64) {
    const uint64_t record_at = offset + cd_size;
    put(d, 0x06064b50, 4);
    put(d, 44, 8);  // the record's size after this field
    put(d, kMadeBy, 2);
    put(d, kNeeded64, 2);
    put(d, 0, 4);  // this disk
    put(d, 0, 4);  // the directory's disk
    put(d, count, 8);
    put(d, count, 8);
    put(d, cd_size, 8);
    put(d, offset, 8);
    put(d, 0x07064b50, 4);  // locator
    put(d, 0, 4);
    put(d, record_at, 8);
    put(d, 1, 4);  // disks
  }
  put(d, 0x06054b50, 4);
  put(d, 0, 2);
  put(d, 0, 2);
  put(d, zip64 ? 0xffff : count, 2);
  put(d, zip64 ? 0xffff : count, 2);
  put(d, zip64 ? kMax32 : cd_size, 4);
  put(d, zip64 ? kMax32 : offset, 4);
  put(d, 0, 2);  // comment
  return d;
}

}  // namespace tdist::checkpoint::zip
