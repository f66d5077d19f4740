// DCP's allowlist (pickle_dcp.h).
#include "formats/pickle_dcp.h"

#include <algorithm>
#include <iterator>

#include "formats/pickle_format.h"
#include "tdist/errors.h"

namespace tdist::checkpoint::pickle {

namespace {

// The classes a DCP .metadata pickles, by module and name (the older
// torch.distributed._shard homes of some too), and the name they read as.
struct DcpClassName {
  const char* module;
  const char* name;
};
constexpr const char* kMeta = "torch.distributed.checkpoint.metadata";
constexpr const char* kShardMeta = "torch.distributed._shard.checkpoint.metadata";  // PyTorch 1.13
const DcpClassName kClasses[] = {
    {kMeta, "Metadata"}, {kMeta, "TensorStorageMetadata"}, {kMeta, "BytesStorageMetadata"},
    {kMeta, "ChunkStorageMetadata"}, {kMeta, "TensorProperties"}, {kMeta, "MetadataIndex"},
    {kMeta, "StorageMeta"}, {"torch.distributed.checkpoint.filesystem", "_StorageInfo"},
    {kShardMeta, "Metadata"}, {kShardMeta, "TensorStorageMetadata"}, {kShardMeta, "BytesStorageMetadata"},
    {kShardMeta, "ChunkStorageMetadata"}, {kShardMeta, "MetadataIndex"},
    {"torch.distributed._shard.checkpoint.filesystem", "_StorageInfo"},
    // PyTorch 1.13 to 2.2 pickle TensorProperties from here.
    {"torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"},
};
const char* const kMemFormats[] = {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"};
constexpr const char* kMemFormatClass = "_MEM_FORMAT_ENCODING";

[[noreturn]] void fail(const std::string& what) { throw CheckpointError(what); }

const std::string& string_arg(const std::vector<PtValue>& a, size_t i, const char* what) {
  if (a.size() <= i || a[i].kind() != PtValue::Kind::String) fail(std::string(what) + " without its string");
  return a[i].as_string();
}

}  // namespace

DcpGlobal dcp_global(const std::string& module, const std::string& name, std::string* as) {
  c10::ScalarType dtype;
  if (module == "torch" && dtype_of_name(name, &dtype)) {
    *as = "torch." + name;
    return DcpGlobal::Dtype;
  }
  if (module == "collections" && name == "OrderedDict") return DcpGlobal::OrderedDict;
  if (module == "torch" && name == "Size") return DcpGlobal::TorchSize;
  if (module == "torch.serialization" && name == "_get_layout") return DcpGlobal::GetLayout;
  if ((module == "builtins" || module == "__builtin__") && name == "getattr") return DcpGlobal::GetAttr;
  if ((module == kMeta || module == "torch.distributed._shard.sharded_tensor.metadata") &&
      (name == kMemFormatClass || name == "MEM_FORMAT_ENCODING")) {
    return DcpGlobal::MemFormat;
  }
  if ((module == "pathlib" || module == "pathlib._local") &&  // pathlib._local: Python 3.13
      (name == "PosixPath" || name == "PurePosixPath" || name == "WindowsPath" || name == "PureWindowsPath" ||
       name == "Path")) {
    return DcpGlobal::Path;
  }
  for (const auto& k : kClasses) {
    if (module == k.module && name == k.name) {
      *as = k.name;
      return DcpGlobal::Class;
    }
  }
  return DcpGlobal::Unknown;
}

std::string dcp_reduce_string(DcpGlobal g, const std::vector<PtValue>& a) {
  switch (g) {
    case DcpGlobal::GetLayout: {
      const std::string& l = string_arg(a, 0, "_get_layout");
      if (a.size() != 1 || l.rfind("torch.", 0) != 0 || l.size() > 64) fail("_get_layout of '" + l.substr(0, 64) + "'");
      return l;
    }
    case DcpGlobal::GetAttr: {
      const std::string& m = string_arg(a, 1, "getattr");
      if (a.size() != 2 || std::find(std::begin(kMemFormats), std::end(kMemFormats), m) == std::end(kMemFormats)) {
        fail("getattr of _MEM_FORMAT_ENCODING." + m.substr(0, 64));
      }
      return std::string(kMemFormatClass) + "." + m;
    }
    case DcpGlobal::MemFormat: {  // by value, as most Pythons pickle enums
      if (a.size() != 1 || a[0].kind() != PtValue::Kind::Int || a[0].as_int() < 0 || a[0].as_int() > 2) {
        fail("_MEM_FORMAT_ENCODING of something not 0, 1 or 2");
      }
      return std::string(kMemFormatClass) + "." + kMemFormats[a[0].as_int()];
    }
    case DcpGlobal::Path: {
      std::string p;
      for (size_t i = 0; i < a.size(); ++i) {
        const std::string& part = string_arg(a, i, "a path");
        if (!p.empty() && p.back() != '/') p += '/';
        p += part;
        if (p.size() > 4096) fail("a path of more than 4096 bytes");
      }
      return p;
    }
    default: fail("a DCP class called as a function");
  }
}

}  // namespace tdist::checkpoint::pickle
