// Reading a Hugging Face shard index. The contract is in hf_index.h.
#include "formats/hf_index.h"

#include <set>
#include <utility>

#include "tdist/errors.h"
#include "util/json_reader.h"
#include "util/open_file.h"
#include "util/printable.h"

namespace tdist::checkpoint {

namespace {

using detail::printable;

// The weight_map's pairs, event by event; everything else is skipped.
class IndexReader : public json::JsonReader {
 public:
  IndexReader() : JsonReader(limits()) {}
  std::map<std::string, std::string> file_of;
  bool has_map = false;  // the key seen (any value but an object fails)

 private:
  enum Tag { kRoot, kMap };
  static json::Limits limits() {
    json::Limits l;
    l.max_depth = 64;
    return l;
  }
  void on_key() override {
    if (top().tag == kRoot && key() == "weight_map" && std::exchange(has_map, true)) fail("two weight_map fields");
  }
  int on_open(bool object) override {
    if (at_root()) return kRoot;
    if (top().tag == kRoot && key() == "weight_map") {
      if (!object) fail("weight_map is an array, not an object");
      return kMap;
    }
    if (top().tag == kMap) fail("weight_map's '" + printable(key()) + "' is " + (object ? "an object" : "an array") + ", not a file name");
    return kSkip;
  }
  void on_scalar(const json::Scalar& v) override {
    if (top().tag == kRoot) {
      if (key() == "weight_map") fail(std::string("weight_map is ") + json::type_name(v.type) + ", not an object");
      return;
    }
    if (v.type != json::Scalar::String) fail("weight_map's '" + printable(key()) + "' is " + json::type_name(v.type) + ", not a file name");
    if (!file_of.emplace(key(), *v.s).second) fail("the key '" + printable(key()) + "' is in weight_map twice");
  }
};

// Why a file name of an index cannot be used ("" when it can): it must
// name a file in the index's own directory.
std::string bad_file_name(const std::string& name) {
  if (name.empty()) return "is empty";
  if (name.find('/') != std::string::npos) return "has a '/' (only files beside the index are read)";
  if (name == "." || name == "..") return "is '" + name + "'";
  if (name.find('\0') != std::string::npos) return "has a NUL byte";
  return "";
}

}  // namespace

WeightMap read_weight_map(const std::string& path) {
  std::string text, error;
  if (!tdist::detail::read_regular_file(path, kMaxIndexBytes + 1, text, error)) throw CheckpointError(error);
  if (text.size() > kMaxIndexBytes) {
    throw CheckpointError(path + ": the index is larger than " + std::to_string(kMaxIndexBytes >> 20) + " MiB");
  }
  IndexReader r;
  const std::string problem = r.parse(text);
  if (!problem.empty()) throw CheckpointError(path + ": not a valid index: " + problem);
  if (!r.has_map) throw CheckpointError(path + ": not a valid index: no weight_map");
  WeightMap m;
  m.file_of = std::move(r.file_of);
  std::set<std::string> seen;
  for (const auto& [key, name] : m.file_of) {
    const std::string why = bad_file_name(name);
    if (!why.empty()) {
      throw CheckpointError(path + ": the file '" + printable(name) + "' of '" + printable(key) + "' " + why + ": refused");
    }
    if (seen.insert(name).second) m.files.push_back(name);
  }
  return m;
}

}  // namespace tdist::checkpoint
