// libFuzzer target for what reads a .pt file someone handed us: the zip
// directory parser and the restricted unpickler. An input starting "PK" is
// a whole zip file: its directory is parsed and checked (every record must
// then lie within the input, and the records written again by the zip
// writer must parse to the same directory), and its <archive>/data.pkl, if
// any, is unpickled; any other input is a pickle. An accepted pickle must
// pickle again (pickle_value) and unpickle to the same value (when its
// tree, memo references expanded, is small enough to write out again in
// the fuzzer's memory limit). Run with -rss_limit_mb and -malloc_limit_mb
// (scripts/fuzz.sh): the readers' memory is bounded while parsing.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "formats/pt_file.h"
#include "formats/zip_format.h"
#include "tdist/errors.h"

namespace ck = tdist::checkpoint;
namespace zip = tdist::checkpoint::zip;

namespace {

std::vector<zip::Entry> directory(const std::string& bytes) {
  return zip::read_directory([&](uint64_t off, void* out, size_t n) { std::memcpy(out, bytes.data() + off, n); },
                             bytes.size());
}

// The records again, through the writer: the same names, sizes and CRCs.
void rewrite(const std::string& in, const std::vector<zip::Entry>& entries) {
  std::string out;
  std::vector<zip::Entry> written;
  for (const zip::Entry& e : entries) {
    zip::Entry w = e;
    w.header_offset = out.size();
    out += zip::local_header(e.name, out.size(), e.size, e.crc, false);
    w.data_offset = out.size();
    out.append(in, static_cast<size_t>(e.data_offset), static_cast<size_t>(e.size));
    written.push_back(w);
  }
  out += zip::central_directory(written, out.size(), written.size() % 2 == 1);
  const std::vector<zip::Entry> again = directory(out);
  if (again.size() != entries.size()) std::abort();
  for (size_t i = 0; i < again.size(); ++i) {
    if (again[i].name != entries[i].name || again[i].size != entries[i].size || again[i].crc != entries[i].crc ||
        again[i].data_offset % zip::kAlignment != 0) {
      std::abort();
    }
  }
}

// The values and string bytes of v written out, memo references expanded;
// stops counting past `cap`.
size_t expanded(const ck::PtValue& v, size_t cap) {
  size_t n = 1;
  switch (v.kind()) {
    case ck::PtValue::Kind::String: return 1 + v.as_string().size();
    case ck::PtValue::Kind::List:
    case ck::PtValue::Kind::Tuple:
      for (const ck::PtValue& x : v.items()) {
        if (n > cap) break;
        n += expanded(x, cap - n);
      }
      return n;
    case ck::PtValue::Kind::Dict:
      for (const auto& [k, x] : v.entries()) {
        if (n > cap) break;
        n += k.size() + expanded(x, cap - n);
      }
      return n;
    default: return 1;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  std::string pkl = in;
  if (size >= 2 && in[0] == 'P' && in[1] == 'K') {
    std::vector<zip::Entry> entries;
    std::string archive;
    try {
      entries = directory(in);
      archive = zip::archive_of(entries);
    } catch (const tdist::CheckpointError&) {
      return 0;
    }
    const zip::Entry* pkl_entry = nullptr;
    for (const zip::Entry& e : entries) {
      if (e.data_offset > size || e.size > size - e.data_offset) std::abort();  // the parser let it past the end
      if (e.name == archive + "/data.pkl") pkl_entry = &e;
    }
    rewrite(in, entries);
    if (pkl_entry == nullptr) return 0;
    pkl = in.substr(static_cast<size_t>(pkl_entry->data_offset), static_cast<size_t>(pkl_entry->size));
  }
  ck::PtValue v;
  try {
    v = ck::unpickle_value(pkl);
  } catch (const tdist::CheckpointError&) {
    return 0;
  }
  if (expanded(v, size_t{1} << 22) > (size_t{1} << 22)) return 0;
  const std::string again = ck::pickle_value(v);  // an accepted value always pickles
  if (ck::unpickle_value(again) != v) std::abort();
  return 0;
}
