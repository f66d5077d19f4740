// The checkpoint tools' LibTorch half: consolidation into torch::save's
// format (which needs LibTorch's serializer and holds the model whole) and
// reading a consolidated .pt file back into tensors. The streaming formats
// are in tools.cpp, which needs c10 only. The contract is in
// include/tdist/sharded_checkpoint.h and checkpoint_tools.h.
#include <ATen/ATen.h>
#include <torch/serialize/output-archive.h>

#include <functional>
#include <memory>
#include <set>

#include "formats/file_io.h"
#include "checkpoint/sharded_tensors.h"
#include "checkpoint/tensor_tree.h"
#include "checkpoint/tools.h"
#include "tdist/sharded_checkpoint.h"

namespace tdist {

namespace {

using checkpoint::LogicalTensor;
using checkpoint::PtValue;
using checkpoint::ShardedCheckpointFiles;

// torch::save's layout of a module: a nested archive per submodule.
void write_libtorch(const ShardedCheckpointFiles& files, const std::string& path) {
  struct Node {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    std::vector<std::pair<std::string, std::unique_ptr<Node>>> children;
    Node& child(const std::string& name) {
      for (auto& [n, c] : children) {
        if (n == name) return *c;
      }
      children.emplace_back(name, std::make_unique<Node>());
      return *children.back().second;
    }
  };
  // TorchScript's reader (torch::load) refuses Python keywords as names:
  // say so rather than write a file nothing can load.
  static const std::set<std::string> kKeywords = {
      "False", "None",   "True",    "and",   "as",   "assert", "async", "await",    "break",  "class",
      "continue", "def", "del",     "elif",  "else", "except", "finally", "for",    "from",   "global",
      "if",    "import", "in",      "is",    "lambda", "nonlocal", "not", "or",     "pass",   "raise",
      "return", "try",   "while",   "with",  "yield"};
  Node root;
  const auto check = [&](const std::string& name, const std::string& part) {
    if (kKeywords.count(part)) {
      throw CheckpointError(path + ": '" + name + "' has the step '" + part +
                            "', a Python keyword, which LibTorch's archive format cannot load: use --format pt "
                            "or safetensors");
    }
  };
  // Every module, those without tensors too: torch::load reads each one's archive.
  for (const auto& m : checkpoint::tag_names(files, "modules")) {
    Node* node = &root;
    size_t from = 0;
    for (size_t dot = 0; dot != std::string::npos; from = dot + 1) {
      dot = m.find('.', from);
      const std::string part = m.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
      check(m, part);
      node = &node->child(part);
    }
  }
  for (const auto& t : files.model()) {
    Node* node = &root;
    std::string rest = t.name;
    for (size_t dot = 0; dot != std::string::npos;) {
      dot = rest.find('.');
      const std::string part = rest.substr(0, dot);
      check(t.name, part);
      if (dot == std::string::npos) break;
      node = &node->child(part);
      rest = rest.substr(dot + 1);
    }
    node->tensors.emplace_back(rest, checkpoint::read_full(files, t));
  }
  const std::vector<std::string> buffers = checkpoint::tag_names(files, "buffers");
  std::function<void(const Node&, torch::serialize::OutputArchive&, const std::string&)> fill =
      [&](const Node& n, torch::serialize::OutputArchive& archive, const std::string& prefix) {
        for (const auto& [name, t] : n.tensors) {
          const bool buffer = std::find(buffers.begin(), buffers.end(), prefix + name) != buffers.end();
          archive.write(name, t, buffer);
        }
        for (const auto& [name, c] : n.children) {
          torch::serialize::OutputArchive sub(archive.compilation_unit());
          fill(*c, sub, prefix + name + ".");
          archive.write(name, sub);
        }
      };
  torch::serialize::OutputArchive archive;
  fill(root, archive, "");
  checkpoint::AtomicFileWriter out(path);  // a temporary of its own, synced and renamed
  archive.save_to([&out](const void* data, size_t n) {
    out.write(data, n);
    return n;
  });
  out.commit();
}


}  // namespace

std::string consolidate_sharded_model_checkpoints(const std::string& ckpt_prefix, const std::string& ckpt_suffix,
                                                  const std::string& save_path, const ConsolidateOptions& options) {
  if (options.format != CheckpointFormat::libtorch) {
    return checkpoint::consolidate_streaming(ckpt_prefix, ckpt_suffix, save_path, options);
  }
  if (options.optimizer) throw UsageError("consolidate: the libtorch format holds the model only");
  const ShardedCheckpointFiles files(ckpt_prefix, ckpt_suffix);
  const std::string path =
      save_path.empty() ? checkpoint::default_consolidated_path(ckpt_prefix, CheckpointFormat::libtorch) : save_path;
  checkpoint::check_output_file(files, ckpt_prefix, ckpt_suffix, path);
  write_libtorch(files, path);
  return path;
}

ConsolidatedCheckpoint load_consolidated_checkpoint(const std::string& path) {
  const checkpoint::PtReader reader(path);
  const PtValue& root = reader.root();
  checkpoint::TensorReads reads(reader);  // each storage once, however often the file names it
  const auto read = [&](const checkpoint::PtTensorRef& ref) { return reads(ref); };
  ConsolidatedCheckpoint out;
  try {
    for (const auto& [name, v] : root.at("model").entries()) out.model.insert(name, read(v.as_tensor()));
    const PtValue* opt = root.find("optimizer");
    if (opt && !opt->is_none()) {
      out.has_optimizer = true;
      checkpoint::check_optimizer_tree(*opt);
      out.optimizer = checkpoint::optimizer_from(*opt, read);
      out.optimizer.world_size = 1;
      out.optimizer.rank = 0;
    }
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    throw CheckpointError(what.compare(0, path.size(), path) == 0 ? what : path + ": " + what);
  }
  return out;
}

}  // namespace tdist
