// PyTorch Distributed Checkpoint (DCP) folders: what their `.metadata`
// says, read without running anything. A DCP folder (what
// torch.distributed.checkpoint.save with FileSystemWriter writes) holds
//   .metadata          a pickled Metadata: for every flattened key ("fqn",
//                      "model.l1.weight", "optim.state.l1.weight.exp_avg")
//                      a TensorStorageMetadata (dtype, global size, the
//                      chunks each a rank saved: offsets and sizes) or a
//                      BytesStorageMetadata (any other value); storage_data
//                      mapping each (fqn, chunk offsets) to the file,
//                      offset and length of its bytes; planner_data mapping
//                      each fqn to its path in the nested dict the save
//                      was given (("optim", "state", "l1.weight",
//                      "exp_avg"); ints for list indices)
//   __<rank>_<n>.distcp the items: each tensor chunk one torch.save of the
//                      chunk (a zip at its offset), or in the safetensors
//                      variant one safetensors blob per file; each other
//                      value one torch.save of it.
// No stable spec exists (pytorch/pytorch#76747); this is the format as
// PyTorch 2.x writes it (read in PyTorch 2.15; older class homes under
// torch.distributed._shard are accepted).
//
// parse_metadata checks as it reads: every class against an allowlist
// (unpickle_dcp_metadata), every size and offset (no overflow, chunks
// inside their tensor, not overlapping, covering it exactly), every
// storage entry naming a chunk that exists, once, by a plain file name in
// the folder. Memory: 48 MiB + 16x the file (the unpickler's bound), plus
// what it returns (linear in the file). Time: linear (n log n sorts).
//
// Errors: CheckpointError naming the folder and the problem. No LibTorch
// (c10's dtypes only): tdist-ckpt uses it.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tdist::checkpoint::dcp {

// The file name PyTorch's FileSystemWriter gives the metadata.
constexpr const char* kMetadataFile = ".metadata";
// The most a .metadata may hold (a 1-billion-parameter model's is ~1 MiB).
constexpr uint64_t kMaxMetadataBytes = uint64_t{256} << 20;

struct Storage {
  std::string file;  // a name in the folder
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct Chunk {
  std::vector<int64_t> offsets;  // where the chunk starts in the whole tensor
  std::vector<int64_t> sizes;
  Storage storage;
  int64_t numel() const;
};

// One entry of the flattened state dict.
struct Item {
  std::string fqn;
  // Its place in the nested dict the save was given; an int part (a list
  // index, or an optimizer's state keyed by parameter index) is kept as
  // its decimal string with `index` set.
  struct Part {
    std::string key;
    bool index = false;
  };
  std::vector<Part> path;
  bool tensor = false;
  // Tensors: the dtype and whole size, and the chunks that cover it, by
  // their offsets (row-major order).
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> size;
  std::vector<Chunk> chunks;
  // Other values: where their torch.save lies.
  Storage bytes;
};

struct Metadata {
  std::vector<Item> items;  // in the order of the file's state_dict_metadata
  std::string version;      // "" in files older than the field
  uint64_t fingerprint = 0;  // read_metadata: a hash of the file's bytes (one save, one value)
  // The item of a flattened key; null when absent.
  const Item* find(const std::string& fqn) const;
  std::map<std::string, size_t> by_fqn;
};

// The .metadata's bytes, read by what they name (`where`: the folder, for
// messages).
Metadata parse_metadata(const std::string& bytes, const std::string& where);

// Whether `dir` is a directory holding a .metadata (a DCP folder).
bool is_dcp_folder(const std::string& dir);
// dir/.metadata read (a regular file of at most kMaxMetadataBytes) and
// parsed; every storage range checked against its file's size (each file
// a regular file in the folder).
Metadata read_metadata(const std::string& dir);

// "model.l1.weight" for the path ("model", "l1.weight"): the path's
// parts joined with '.'.
std::string joined(const std::vector<Item::Part>& path);

// The pickle of `m` as PyTorch's FileSystemReader reads it (protocol 2:
// the DCP classes by their torch.distributed.checkpoint names, each
// item's path as planner_data, version "1.0.0"; TensorProperties as its
// five-part state, which PyTorch 2.0 to 2.15 all take). Every chunk and
// bytes item must have its storage. (dcp_metadata_writer.cpp)
std::string pickle_metadata(const Metadata& m);

}  // namespace tdist::checkpoint::dcp
