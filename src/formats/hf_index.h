// A Hugging Face shard index (model.safetensors.index.json,
// pytorch_model.bin.index.json): {"metadata": ..., "weight_map": {key:
// file}}. Read through the bounded JSON reader (util/json_reader.h) with
// at most kMaxIndexBytes of text; only the map's pairs are kept (metadata
// and other fields are skipped). Every file must be a plain name in the
// index's own directory (no '/', not "." or "..", no NUL); a key given
// twice, a value that is not a string, no weight_map: CheckpointError
// naming the index.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tdist::checkpoint {

inline constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;

struct WeightMap {
  std::map<std::string, std::string> file_of;  // tensor key -> file name
  std::vector<std::string> files;              // each file once, in the order of file_of's keys
};

WeightMap read_weight_map(const std::string& index_path);

}  // namespace tdist::checkpoint
