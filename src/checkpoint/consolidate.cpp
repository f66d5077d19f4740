// The checkpoint tools over a sharded checkpoint's files: consolidation
// into one full state dict (pt, safetensors or libtorch), resharding to
// another world size, inspection, and reading a consolidated file back.
// Each streams: one full tensor in memory at a time (libtorch excepted:
// torch::serialize keeps its archive whole). The contract is in
// include/tdist/sharded_checkpoint.h.
#include <ATen/ATen.h>
#include <torch/serialize/output-archive.h>

#include <map>
#include <memory>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_tree.h"
#include "checkpoint/file_io.h"
#include "checkpoint/sharded_files.h"
#include "tdist/checkpoint.h"
#include "tdist/sharded_checkpoint.h"

namespace tdist {

namespace {

using checkpoint::LogicalTensor;
using checkpoint::PtValue;
using checkpoint::ShardedCheckpointFiles;

// The optimizer state of `tensors` grouped by parameter: {param: {field: value}}.
PtValue state_tree(const std::vector<LogicalTensor>& tensors,
                   const std::function<PtValue(const LogicalTensor&)>& value) {
  std::vector<std::pair<std::string, PtValue>> params;
  for (const auto& t : tensors) {
    if (params.empty() || params.back().first != t.param) params.emplace_back(t.param, PtValue::dict({}));
    params.back().second.mutable_entries().emplace_back(t.field, value(t));
  }
  return PtValue::dict(std::move(params));
}

// The tdist tag's list `key` (buffers, modules) of rank 0's file.
std::vector<std::string> tag_names(const ShardedCheckpointFiles& files, const char* key) {
  std::vector<std::string> out;
  if (const PtValue* b = files.reader(0).root().at("tdist").find(key)) {
    for (const auto& n : b->items()) out.push_back(n.as_string());
  }
  return out;
}
std::vector<std::string> buffer_names(const ShardedCheckpointFiles& files) { return tag_names(files, "buffers"); }

void write_pt(const ShardedCheckpointFiles& files, const std::string& path, bool optimizer) {
  checkpoint::TensorSink sink;
  const auto lazy = [&](const LogicalTensor& t) {
    return sink.add(t.dtype, t.shape, [&files, &t] { return files.read_full_reused(t); });
  };
  std::vector<std::pair<std::string, PtValue>> model;
  for (const auto& t : files.model()) model.emplace_back(t.name, lazy(t));
  PtValue opt;
  if (optimizer) opt = checkpoint::optimizer_tree(files.optimizer_tree(), state_tree(files.optimizer(), lazy), 1, 0);
  const PtValue root = PtValue::dict({{"model", PtValue::dict(std::move(model))},
                                      {"optimizer", std::move(opt)},
                                      {"tdist", PtValue::dict({{"format", PtValue::integer(checkpoint::kFormatVersion)},
                                                               {"kind", PtValue::string("consolidated")}})}});
  checkpoint::PtWriter writer(path);
  sink.write(writer, root);
  writer.finish();
}

void write_safetensors(const ShardedCheckpointFiles& files, const std::string& path, bool optimizer) {
  std::vector<const LogicalTensor*> all;
  for (const auto& t : files.model()) all.push_back(&t);
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  if (optimizer) {
    for (const auto& t : files.optimizer()) all.push_back(&t);
    // The groups' options and parameter names, as JSON.
    nlohmann::json groups = nlohmann::json::array();
    for (const auto& g : files.optimizer_tree().at("param_groups").items()) {
      nlohmann::json group;
      for (const auto& [name, v] : g.entries()) {
        if (name == "params") {
          group["params"] = nlohmann::json::array();
          for (const auto& n : v.items()) group["params"].push_back(n.as_string());
        } else {
          group[name] = v.as_float();
        }
      }
      groups.push_back(group);
    }
    metadata["tdist.optimizer"] = files.optimizer_tree().at("optimizer").as_string();
    metadata["tdist.param_groups"] = groups.dump();
  }
  const auto name_of = [](const LogicalTensor& t) { return t.field.empty() ? t.name : "optimizer/" + t.name; };
  std::vector<SafetensorsTensorInfo> infos;
  for (const auto* t : all) infos.push_back({name_of(*t), t->dtype, t->shape});
  SafetensorsWriter writer(path, infos, metadata);
  for (const auto* t : all) writer.write(name_of(*t), files.read_full_reused(*t));
  writer.finish();
}

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
  for (const auto& m : tag_names(files, "modules")) {
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
    node->tensors.emplace_back(rest, files.read_full(t));
  }
  const std::vector<std::string> buffers = buffer_names(files);
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
  const ShardedCheckpointFiles files(ckpt_prefix, ckpt_suffix);
  if (options.optimizer && !files.has_optimizer()) {
    throw CheckpointError("the checkpoint " + ckpt_prefix + ckpt_suffix + " holds no optimizer state");
  }
  std::string path = save_path;
  switch (options.format) {
    case CheckpointFormat::pt:
      if (path.empty()) path = ckpt_prefix + "_consolidated.pt";
      write_pt(files, path, options.optimizer);
      break;
    case CheckpointFormat::safetensors:
      if (path.empty()) path = ckpt_prefix + "_consolidated.safetensors";
      write_safetensors(files, path, options.optimizer);
      break;
    case CheckpointFormat::libtorch:
      if (options.optimizer) throw UsageError("consolidate: the libtorch format holds the model only");
      if (path.empty()) path = ckpt_prefix + "_consolidated.libtorch.pt";
      write_libtorch(files, path);
      break;
  }
  return path;
}

void reshard_sharded_checkpoint(const std::string& ckpt_prefix, const std::string& ckpt_suffix, int world_size,
                                const std::string& out_prefix) {
  if (world_size < 1) throw UsageError("reshard: the world size must be at least 1");
  if (out_prefix == ckpt_prefix) throw UsageError("reshard: write to another prefix than the checkpoint's own");
  const ShardedCheckpointFiles files(ckpt_prefix, ckpt_suffix);
  const auto rows_on = [&](const LogicalTensor& t, int r, int64_t& first) {
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const int64_t per = (rows + world_size - 1) / world_size;
    first = r * per;
    return std::clamp<int64_t>(rows - first, 0, per);
  };
  std::random_device rd;
  const int64_t save_id = static_cast<int64_t>((static_cast<uint64_t>(rd()) << 31) ^ rd()) & INT64_MAX;
  std::vector<std::unique_ptr<checkpoint::PtWriter>> writers;
  std::vector<std::vector<std::string>> keys;  // per rank: storage keys in writing order
  for (int r = 0; r < world_size; ++r) {
    checkpoint::TensorSink sink;  // hands out the keys; the bytes are written below, in lockstep
    const auto piece = [&](const LogicalTensor& t) {
      int64_t first = 0;
      return sink.add(t.dtype, t.sharded ? checkpoint::rows_shape(t.shape, rows_on(t, r, first)) : t.shape, nullptr);
    };
    std::vector<std::pair<std::string, PtValue>> model;
    for (const auto& t : files.model()) model.emplace_back(t.name, piece(t));
    PtValue opt;
    if (files.has_optimizer()) {
      opt = checkpoint::optimizer_tree(files.optimizer_tree(), state_tree(files.optimizer(), piece), world_size, r);
    }
    ShardMetadata md = files.metadata();
    md.world_size = world_size;
    md.rank = r;
    for (auto& u : md.units) {
      for (auto& p : u.params) {
        const int64_t rows = p.shape.empty() ? 1 : p.shape[0];
        const int64_t per = u.sharded ? (rows + world_size - 1) / world_size : rows;
        p.rows_per_rank = per;
        p.first_row = u.sharded ? r * per : 0;
        p.padding_rows = u.sharded ? per * world_size - rows : 0;
        p.shard_shape = u.sharded ? checkpoint::rows_shape(p.shape, std::clamp<int64_t>(rows - p.first_row, 0, per)) : p.shape;
      }
    }
    std::vector<PtValue> buffers, modules;
    for (const auto& b : buffer_names(files)) buffers.push_back(PtValue::string(b));
    for (const auto& m : tag_names(files, "modules")) modules.push_back(PtValue::string(m));
    const PtValue* ddp_buckets = files.reader(0).root().at("tdist").find("ddp_buckets");
    const PtValue root = PtValue::dict(
        {{"model", PtValue::dict(std::move(model))},
         {"shard_metadata", checkpoint::metadata_value(md)},
         {"optimizer", std::move(opt)},
         {"comm_hook", PtValue()},
         {"tdist", PtValue::dict({{"format", PtValue::integer(checkpoint::kFormatVersion)},
                                  {"kind", PtValue::string("sharded")},
                                  {"save_id", PtValue::integer(save_id)},
                                  {"world_size", PtValue::integer(world_size)},
                                  {"rank", PtValue::integer(r)},
                                  {"buffers", PtValue::list(std::move(buffers))},
                                  {"modules", PtValue::list(std::move(modules))},
                                  {"ddp_buckets", ddp_buckets ? *ddp_buckets : PtValue()}})}});
    writers.push_back(std::make_unique<checkpoint::PtWriter>(
        checkpoint::rank_file_path(out_prefix, ckpt_suffix, r, world_size)));
    writers.back()->begin(root);
    keys.push_back(checkpoint::tensor_keys(root));
  }
  // Each tensor read whole once and handed to every rank's file.
  size_t k = 0;
  const auto spread = [&](const LogicalTensor& t) {
    const at::Tensor full = files.read_full_reused(t);
    for (int r = 0; r < world_size; ++r) {
      int64_t first = 0;
      const int64_t rows = rows_on(t, r, first);
      at::Tensor part = full;
      if (t.sharded) {
        part = t.shape.empty() ? (rows ? full : full.reshape({1}).narrow(0, 0, 0))
                               : full.narrow(0, std::min(first, t.shape[0]), rows);  // a rank of no rows may start past the end
      }
      writers[static_cast<size_t>(r)]->write_storage(keys[static_cast<size_t>(r)][k], part);
    }
    ++k;
  };
  for (const auto& t : files.model()) spread(t);
  if (files.has_optimizer()) {
    for (const auto& t : files.optimizer()) spread(t);
  }
  for (auto& w : writers) w->sync();
  for (auto& w : writers) w->commit();
}

ShardedCheckpointInfo inspect_sharded_checkpoint(const std::string& ckpt_prefix, const std::string& ckpt_suffix) {
  const ShardedCheckpointFiles files(ckpt_prefix, ckpt_suffix);
  ShardedCheckpointInfo info;
  info.world_size = files.world_size();
  info.files = files.paths();
  for (const auto& u : files.metadata().units) info.units.push_back(u.prefix);
  const auto describe = [](const LogicalTensor& t) {
    return CheckpointTensorInfo{t.name, t.shape, t.dtype, t.bytes(), t.sharded};
  };
  for (const auto& t : files.model()) info.model.push_back(describe(t));
  if (files.has_optimizer()) {
    info.optimizer = files.optimizer_tree().at("optimizer").as_string();
    for (const auto& t : files.optimizer()) info.optimizer_state.push_back(describe(t));
  }
  return info;
}

ConsolidatedCheckpoint load_consolidated_checkpoint(const std::string& path) {
  const checkpoint::PtReader reader(path);
  const PtValue& root = reader.root();
  const auto read = [&](const checkpoint::PtTensorRef& ref) { return reader.read_tensor(ref); };
  ConsolidatedCheckpoint out;
  try {
    for (const auto& [name, v] : root.at("model").entries()) out.model.insert(name, read(v.as_tensor()));
    const PtValue* opt = root.find("optimizer");
    if (opt && !opt->is_none()) {
      out.has_optimizer = true;
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
