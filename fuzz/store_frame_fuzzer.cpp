// libFuzzer target for the TCPStore frame parser, the code that reads
// untrusted bytes off the network. For every input it parses as many frames
// as it can, both as requests and as replies; any frame it accepts must
// re-encode to exactly the bytes it consumed.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "store/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tdist::TCPStoreLimits limits;
  limits.max_value_bytes = 1 << 16;
  limits.max_key_bytes = 1 << 10;
  limits.max_keys_per_request = 1 << 10;
  for (bool is_request : {true, false}) {
    size_t pos = 0;
    while (pos < size) {
      tdist::wire::Message m;
      auto r = tdist::wire::parse_frame(data + pos, size - pos, limits, is_request, &m);
      if (r.status != tdist::wire::ParseStatus::kOk) break;
      if (r.consumed == 0 || r.consumed > size - pos) std::abort();
      std::string again;
      tdist::wire::encode_frame(m, &again);
      if (again.size() != r.consumed || again.compare(0, again.size(), reinterpret_cast<const char*>(data + pos),
                                                      r.consumed) != 0) {
        std::abort();
      }
      pos += r.consumed;
    }
  }
  return 0;
}
