// libFuzzer target for the safetensors header parser, the code that reads
// the first bytes of a checkpoint file someone handed us. Each input is a
// whole file: its length prefix and header are parsed and checked against
// its size; a header that is accepted must make the same header again
// (make_header) and parse to the same tensors and metadata.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "formats/safetensors_header.h"

namespace st = tdist::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  st::Header h;
  uint64_t n = 0;
  try {
    n = st::header_length(data, size);  // refuses size < 8 before reading
    h = st::parse_header(reinterpret_cast<const char*>(data) + 8, static_cast<size_t>(n), size - 8 - n);
  } catch (const st::FormatError&) {
    return 0;
  }
  std::vector<st::TensorEntry> again = h.tensors;
  const std::string made = st::make_header(again, h.metadata);
  const uint64_t n2 = st::header_length(reinterpret_cast<const uint8_t*>(made.data()), made.size() + (size - 8 - n));
  const st::Header h2 = st::parse_header(made.data() + 8, static_cast<size_t>(n2), size - 8 - n);
  if (h2.metadata != h.metadata || h2.tensors.size() != h.tensors.size()) std::abort();
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const auto &a = h.tensors[i], &b = h2.tensors[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.begin != b.begin || a.end != b.end) {
      std::abort();
    }
  }
  return 0;
}
