// libFuzzer target for a DCP folder's .metadata someone handed us: the
// restricted unpickler with DCP's allowlist, then the interpretation
// (classes, chunks, storage entries; dcp_metadata.h). An accepted input
// must write again (pickle_metadata) and read back to the same items,
// chunks and storage. Run with -rss_limit_mb and -malloc_limit_mb
// (scripts/fuzz.sh): memory is bounded while parsing, and nothing in the
// input is ever called.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "formats/dcp_metadata.h"
#include "tdist/errors.h"

namespace dcp = tdist::checkpoint::dcp;

namespace {

bool same(const dcp::Metadata& a, const dcp::Metadata& b) {
  if (a.items.size() != b.items.size()) return false;
  for (size_t i = 0; i < a.items.size(); ++i) {
    const dcp::Item &x = a.items[i], &y = b.items[i];
    if (x.fqn != y.fqn || x.tensor != y.tensor || x.dtype != y.dtype || x.size != y.size ||
        x.chunks.size() != y.chunks.size() || x.path.size() != y.path.size() || x.bytes.file != y.bytes.file ||
        x.bytes.offset != y.bytes.offset || x.bytes.length != y.bytes.length) {
      return false;
    }
    for (size_t k = 0; k < x.chunks.size(); ++k) {
      const dcp::Chunk &c = x.chunks[k], &d = y.chunks[k];
      if (c.offsets != d.offsets || c.sizes != d.sizes || c.storage.file != d.storage.file ||
          c.storage.offset != d.storage.offset || c.storage.length != d.storage.length) {
        return false;
      }
    }
    for (size_t k = 0; k < x.path.size(); ++k) {
      if (x.path[k].key != y.path[k].key || x.path[k].index != y.path[k].index) return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  dcp::Metadata m;
  try {
    m = dcp::parse_metadata(bytes, "fuzz");
  } catch (const tdist::CheckpointError&) {
    return 0;
  }
  std::string again;
  try {
    again = dcp::pickle_metadata(m);
  } catch (const tdist::UsageError&) {
    return 0;  // a name that is not UTF-8 or a dtype without a DCP name: refused on writing, as it should be
  }
  if (!same(m, dcp::parse_metadata(again, "fuzz (written again)"))) std::abort();
  return 0;
}
