// DCP's allowlist for the unpickler's DcpMetadata dialect (pt_file.h's
// unpickle_dcp_metadata): which globals a .metadata may name, and what
// the few callables it may REDUCE make. Pure lookups and checks, nothing
// called; the unpickler (pickle_reader.cpp) charges what they return to
// its budget and names the byte of a CheckpointError. Internal to
// tdist_files.
#pragma once

#include <string>
#include <vector>

#include "formats/pt_file.h"

namespace tdist::checkpoint::pickle {

enum class DcpGlobal : uint8_t {
  Unknown,      // not on the list: refused
  Dtype,        // torch.<dtype>: a value ("torch.float32")
  OrderedDict,  // collections.OrderedDict
  TorchSize,    // torch.Size(tuple of ints)
  GetLayout,    // torch.serialization._get_layout("torch.strided")
  GetAttr,      // getattr(_MEM_FORMAT_ENCODING, "TORCH_...") only
  MemFormat,    // the memory-format enum class (also called with its value)
  Path,         // pathlib's paths (StorageMeta's checkpoint_id)
  Class,        // one of DCP's dataclasses
};

// What module.name is on DCP's list. `as`: a Class's name as the
// interpreter knows it ("TensorStorageMetadata", whichever module it came
// from); a Dtype's value ("torch.float32").
DcpGlobal dcp_global(const std::string& module, const std::string& name, std::string* as);

// The string a REDUCE of `g` (GetLayout, GetAttr, MemFormat, Path) with
// `args` stands for: the layout's name, "_MEM_FORMAT_ENCODING.<member>", the
// path. For GetAttr the caller has checked that args[0] is the enum class.
// CheckpointError (without a byte: the caller adds it) for arguments DCP
// does not write, or another g.
std::string dcp_reduce_string(DcpGlobal g, const std::vector<PtValue>& args);

}  // namespace tdist::checkpoint::pickle
