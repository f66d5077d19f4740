// The checkpoint tools that stream (tools.h, include/tdist/checkpoint_tools.h):
// consolidation into pt or safetensors, resharding, inspection. The bytes
// go from the ranks' files to the output a chunk at a time (1 MiB, which
// stays in the CPU's cache between the read, the CRC check and the write):
// memory does not grow with the model or its largest tensor. Each output
// is renamed into place only after every input record's CRC has matched.
#include "checkpoint/tools.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <memory>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_tree.h"
#include "checkpoint/latest_marker.h"
#include "formats/pt_file.h"
#include "tdist/safetensors.h"
#include "tdist/errors.h"
#include "util/open_file.h"

namespace tdist::checkpoint {

namespace {

// The optimizer state of `tensors` grouped by parameter: {param: {field: value}}.
PtValue state_tree(const std::vector<LogicalTensor>& tensors, const std::function<PtValue(const LogicalTensor&)>& value) {
  std::vector<std::pair<std::string, PtValue>> params;
  for (const auto& t : tensors) {
    if (params.empty() || params.back().first != t.param) params.emplace_back(t.param, PtValue::dict({}));
    params.back().second.mutable_entries().emplace_back(t.field, value(t));
  }
  return PtValue::dict(std::move(params));
}

void write_pt(const ShardedCheckpointFiles& files, const std::string& path, bool optimizer) {
  StorageKeys keys;
  std::unordered_map<std::string, const LogicalTensor*> by_key;
  const auto value = [&](const LogicalTensor& t) {
    PtValue v = keys.add(t.dtype, t.shape);
    by_key[v.as_tensor().storage_key] = &t;
    return v;
  };
  std::vector<std::pair<std::string, PtValue>> model;
  for (const auto& t : files.model()) model.emplace_back(t.name, value(t));
  PtValue opt;
  if (optimizer) opt = optimizer_tree(files.optimizer_tree(), state_tree(files.optimizer(), value), 1, 0);
  const PtValue root = PtValue::dict({{"model", PtValue::dict(std::move(model))},
                                      {"optimizer", std::move(opt)},
                                      {"tdist", PtValue::dict({{"format", PtValue::integer(kFormatVersion)},
                                                               {"kind", PtValue::string("consolidated")}})}});
  PtWriter writer(path);
  writer.begin(root);
  for (const auto& key : tensor_keys(root)) {
    writer.begin_storage(key);
    files.stream_full(*by_key.at(key), [&writer](const char* data, size_t n) { writer.append(data, n); });
    writer.end_storage();
  }
  writer.finish();
}

void write_safetensors(const ShardedCheckpointFiles& files, const std::string& path, bool optimizer) {
  std::vector<const LogicalTensor*> all;
  for (const auto& t : files.model()) all.push_back(&t);
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  if (optimizer) {
    for (const auto& t : files.optimizer()) all.push_back(&t);
    for (auto& [k, v] : optimizer_metadata(files.optimizer_tree())) metadata[k] = v;
  }
  const auto name_of = [](const LogicalTensor& t) { return t.field.empty() ? t.name : "optimizer/" + t.name; };
  std::vector<SafetensorsTensorInfo> infos;
  for (const auto* t : all) infos.push_back({name_of(*t), t->dtype, t->shape});
  SafetensorsWriter writer(path, infos, metadata);
  for (const auto* t : all) {
    writer.begin_tensor(name_of(*t));
    files.stream_full(*t, [&writer](const char* data, size_t n) { writer.append(data, n); });
    writer.end_tensor();
  }
  writer.finish();
}

// The device and inode of each input file.
std::vector<std::pair<dev_t, ino_t>> input_ids(const ShardedCheckpointFiles& files) {
  std::vector<std::pair<dev_t, ino_t>> out;
  for (const auto& p : files.paths()) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0) out.emplace_back(st.st_dev, st.st_ino);
  }
  return out;
}

// The input that `path` is (following links), or nullptr.
const std::string* same_as_input(const ShardedCheckpointFiles& files, const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return nullptr;
  const auto ids = input_ids(files);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == std::make_pair(st.st_dev, st.st_ino)) return &files.paths()[i];
  }
  return nullptr;
}

// What a record holds, in a few words.
std::string describe_value(const PtValue& v) {
  switch (v.kind()) {
    case PtValue::Kind::None: return "None";
    case PtValue::Kind::Bool: return "a bool";
    case PtValue::Kind::Int: return "an int";
    case PtValue::Kind::Float: return "a float";
    case PtValue::Kind::String: return "a string of " + std::to_string(v.as_string().size()) + " bytes";
    case PtValue::Kind::List:
    case PtValue::Kind::Tuple: return "a list of " + std::to_string(v.items().size()) + " items";
    case PtValue::Kind::Dict: return "a dict of " + std::to_string(v.entries().size()) + " entries";
    case PtValue::Kind::Tensor: {
      const PtTensorRef& t = v.as_tensor();
      return std::string("a ") + c10::toString(t.dtype) + " tensor " + shape_string(t.sizes);
    }
  }
  return "a value";
}

}  // namespace

void check_output_file(const ShardedCheckpointFiles& files, const std::string& prefix, const std::string& suffix,
                       const std::string& path) {
  if (const std::string* input = same_as_input(files, path)) {
    throw UsageError("the output " + path + " is the checkpoint's own file " + *input +
                     " (writing it would destroy the checkpoint): choose another path");
  }
  if (is_rank_file_name(prefix, suffix, path)) {
    throw UsageError("the output " + path + " is named like a rank file of the checkpoint " + prefix + suffix +
                     " (it would join that set and break it): choose another path");
  }
}

void check_output_prefix(const ShardedCheckpointFiles& files, const std::string& prefix, const std::string& suffix,
                         const std::string& out_prefix, int world_size) {
  for (int r = 0; r < world_size; ++r) {
    check_output_file(files, prefix, suffix, rank_file_path(out_prefix, suffix, r, world_size));
  }
  for (const RankFile& f : find_rank_files(out_prefix, suffix)) {
    if (const std::string* input = same_as_input(files, f.path)) {
      throw UsageError("the output prefix " + out_prefix + " names the checkpoint's own files (" + *input +
                       "): write to another prefix");
    }
    if ((f.world_size >= 0 && f.world_size != world_size) || f.rank >= world_size) {
      throw UsageError("the output prefix " + out_prefix + " already holds another checkpoint (" + f.path +
                       "); two world sizes under one prefix load as neither: remove it or choose another prefix");
    }
  }
}

// tdist.ddp_buckets, copied into resharded files: None, or a list of lists
// of parameter indices (ints >= 0). CheckpointError naming path otherwise.
static void check_ddp_buckets(const PtValue* v, const std::string& path) {
  if (!v || v->is_none()) return;
  auto bad = [&](const std::string& why) {
    throw CheckpointError(path + ": tdist.ddp_buckets " + why + "; not a file tdist wrote");
  };
  if (v->kind() != PtValue::Kind::List) bad("is not a list");
  for (const auto& b : v->items()) {
    if (b.kind() != PtValue::Kind::List) bad("holds something other than a list of parameter indices");
    for (const auto& k : b.items()) {
      if (k.kind() != PtValue::Kind::Int || k.as_int() < 0) bad("holds something other than a parameter index");
    }
  }
}

std::vector<std::string> other_records(const ShardedCheckpointFiles& files) {
  static const char* const known[] = {"model", "shard_metadata", "optimizer", "tdist", "comm_hook"};
  std::vector<std::string> out;
  for (int r = 0; r < files.world_size(); ++r) {
    for (const auto& [name, value] : files.reader(r).root().entries()) {
      const bool expected = std::find(std::begin(known), std::end(known), name) != std::end(known);
      if (expected && (name != "comm_hook" || value.is_none())) continue;
      std::string what = "unknown to tdist";
      if (expected) {  // comm_hook: its layout checked, as a load would (nothing in it runs)
        try {
          what = checkpoint::check_comm_hook(&value) == checkpoint::CommHookRecord::legacy_archive
                     ? "an old LibTorch archive of DDP comm hook state: loads refuse it, nothing in it runs"
                     : "DDP PowerSGD hook state, read only by a load that asks for it";
        } catch (const CheckpointError& e) {
          what = std::string("malformed DDP comm hook state, loads refuse it: ") + e.what();
        }
      }
      out.push_back(files.paths()[static_cast<size_t>(r)] + ": " + name + " (" + describe_value(value) + "; " + what +
                    ")");
    }
  }
  return out;
}

std::vector<std::string> tag_names(const ShardedCheckpointFiles& files, const char* key) {
  std::vector<std::string> out;
  if (const PtValue* b = files.reader(0).root().at("tdist").find(key)) {
    for (const auto& n : b->items()) out.push_back(n.as_string());
  }
  return out;
}

std::string default_consolidated_path(const std::string& ckpt_prefix, CheckpointFormat format) {
  switch (format) {
    case CheckpointFormat::pt: return ckpt_prefix + "_consolidated.pt";
    case CheckpointFormat::safetensors: return ckpt_prefix + "_consolidated.safetensors";
    case CheckpointFormat::libtorch: return ckpt_prefix + "_consolidated.libtorch.pt";
  }
  throw UsageError("consolidate: an unknown format");
}

std::map<std::string, std::string> optimizer_metadata(const PtValue& tree) {
  nlohmann::json groups = nlohmann::json::array();  // the groups' options and parameter names
  for (const auto& g : tree.at("param_groups").items()) {
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
  return {{"tdist.optimizer", tree.at("optimizer").as_string()}, {"tdist.param_groups", groups.dump()}};
}

std::string consolidate_streaming(const std::string& ckpt_prefix, const std::string& ckpt_suffix,
                                  const std::string& save_path, const ConsolidateOptions& options) {
  if (options.format == CheckpointFormat::libtorch) {
    throw UsageError("consolidate: the libtorch format needs LibTorch (libtdist's "
                     "consolidate_sharded_model_checkpoints, or tdist-ckpt, which hands it to tdist-ckpt-libtorch)");
  }
  const ShardedCheckpointFiles files(ckpt_prefix, ckpt_suffix);
  if (options.optimizer && !files.has_optimizer()) {
    throw CheckpointError("the checkpoint " + ckpt_prefix + ckpt_suffix + " holds no optimizer state");
  }
  const std::string path = save_path.empty() ? default_consolidated_path(ckpt_prefix, options.format) : save_path;
  check_output_file(files, ckpt_prefix, ckpt_suffix, path);
  if (options.format == CheckpointFormat::pt) {
    write_pt(files, path, options.optimizer);
  } else {
    write_safetensors(files, path, options.optimizer);
  }
  return path;
}

namespace {

// The prefix of a Checkpointer's step folder's model files
// (checkpointer.cpp; the marker and folder names: latest_marker.h).
constexpr const char* kModel = "model";

// Whether `dir` has an entry whose name starts with `start`.
bool has_entry_starting(const std::string& dir, const std::string& start) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return false;
  bool found = false;
  while (dirent* e = ::readdir(d)) {
    if (std::string(e->d_name).compare(0, start.size(), start) == 0) {
      found = true;
      break;
    }
  }
  ::closedir(d);
  return found;
}

std::string file_name(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

std::string parent_dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

InspectTarget resolve_inspect_target(const std::string& path, const std::string& suffix) {
  struct stat st {};
  if (path.empty() || ::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return {path, ""};
  std::string dir = path;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string files_start = std::string(kModel) + suffix.substr(0, suffix.find('*'));
  const std::string marker = dir + "/" + kLatestMarker;
  if (::lstat(marker.c_str(), &st) == 0) {  // a root: whatever is there is the marker, and read as one
    const auto folders = read_latest_marker(dir, "tdist-ckpt inspect");
    if (folders.empty()) throw CheckpointError("tdist-ckpt inspect: the latest marker " + marker + " is gone");
    const std::string folder = dir + "/" + folders.front().name;
    const bool there = ::lstat(folder.c_str(), &st) == 0;
    if (!there || !S_ISDIR(st.st_mode)) {
      throw CheckpointError("tdist-ckpt inspect: the latest marker " + marker + " names " + folders.front().name +
                            ", but " + folder + (there ? " is " + detail::file_type_name(st.st_mode) + ", not a directory"
                                            : " is not there"));
    }
    return {folder + "/" + kModel, "the newest of the " + std::to_string(folders.size()) +
                                       " checkpoints that " + marker + " lists"};
  }
  if (has_entry_starting(dir, files_start)) return {dir + "/" + kModel, "a Checkpointer's step folder"};
  // Files named with the directory's path as their prefix (a checkpoint
  // saved as "x" beside a directory "x"): as before.
  if (has_entry_starting(parent_dir(dir), file_name(dir) + suffix.substr(0, suffix.find('*')))) return {path, ""};
  throw CheckpointError("no checkpoint in " + dir + ": a directory with neither a Checkpointer's latest marker nor " +
                        files_start + "*" + " files (a step folder's); for files PREFIX" + suffix + " give PREFIX");
}

}  // namespace tdist::checkpoint

namespace tdist {

using checkpoint::LogicalTensor;
using checkpoint::PtValue;
using checkpoint::ShardedCheckpointFiles;

// Every output rank file is open at once while resharding.
constexpr int kMaxReshardWorld = 1 << 16;

void reshard_sharded_checkpoint(const std::string& ckpt_prefix, const std::string& ckpt_suffix, int world_size,
                                const std::string& out_prefix) {
  if (world_size < 1) throw UsageError("reshard: the world size must be at least 1");
  if (world_size > kMaxReshardWorld) {
    throw UsageError("reshard: world size " + std::to_string(world_size) + " is over " +
                     std::to_string(kMaxReshardWorld) + " (one open file per rank)");
  }
  if (out_prefix == ckpt_prefix) throw UsageError("reshard: write to another prefix than the checkpoint's own");
  const ShardedCheckpointFiles files(ckpt_prefix, ckpt_suffix);
  checkpoint::check_output_prefix(files, ckpt_prefix, ckpt_suffix, out_prefix, world_size);
  // FSDP's layout: every rank ceil(rows / world_size) rows, the last ones fewer or none.
  const auto per_rank = [&](int64_t rows) { return (rows + world_size - 1) / world_size; };
  const auto rows_on = [&](const LogicalTensor& t, int r, int64_t& first) {
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const int64_t per = per_rank(rows);
    first = r * per;
    return std::clamp<int64_t>(rows - first, 0, per);
  };
  const int64_t save_id = checkpoint::new_save_id();
  std::vector<std::unique_ptr<checkpoint::PtWriter>> writers;
  // Per rank: each tensor's storage key, in the order spread() goes below
  // (model, then optimizer state); PtWriter refuses any other order than
  // the pickle's, so a tree built otherwise fails loudly, never swaps bytes.
  std::vector<std::vector<std::string>> keys;
  for (int r = 0; r < world_size; ++r) {
    checkpoint::StorageKeys sink;  // the bytes are written below, in lockstep
    keys.emplace_back();
    const auto piece = [&](const LogicalTensor& t) {
      int64_t first = 0;
      PtValue v = sink.add(t.dtype, t.sharded ? checkpoint::rows_shape(t.shape, rows_on(t, r, first)) : t.shape);
      keys.back().push_back(v.as_tensor().storage_key);
      return v;
    };
    std::vector<std::pair<std::string, PtValue>> model;
    for (const auto& t : files.model()) model.emplace_back(t.name, piece(t));
    PtValue opt;
    if (files.has_optimizer()) {
      opt = checkpoint::optimizer_tree(files.optimizer_tree(), checkpoint::state_tree(files.optimizer(), piece),
                                       world_size, r);
    }
    ShardMetadata md = files.metadata();
    md.world_size = world_size;
    md.rank = r;
    for (auto& u : md.units) {
      for (auto& p : u.params) {
        const int64_t rows = p.shape.empty() ? 1 : p.shape[0];
        const int64_t per = u.sharded ? per_rank(rows) : rows;
        p.rows_per_rank = per;
        p.first_row = u.sharded ? r * per : 0;
        p.padding_rows = u.sharded ? per * world_size - rows : 0;
        p.shard_shape = u.sharded ? checkpoint::rows_shape(p.shape, std::clamp<int64_t>(rows - p.first_row, 0, per)) : p.shape;
      }
    }
    std::vector<PtValue> buffers, modules;
    for (const auto& b : checkpoint::tag_names(files, "buffers")) buffers.push_back(PtValue::string(b));
    for (const auto& m : checkpoint::tag_names(files, "modules")) modules.push_back(PtValue::string(m));
    const PtValue* ddp_buckets = files.reader(0).root().at("tdist").find("ddp_buckets");
    checkpoint::check_ddp_buckets(ddp_buckets, files.paths()[0]);
    const PtValue root = PtValue::dict(
        {{"model", PtValue::dict(std::move(model))},
         {"shard_metadata", checkpoint::metadata_value(md)},
         {"optimizer", std::move(opt)},
         {"comm_hook", PtValue()},
         {"tdist", checkpoint::sharded_record(save_id, world_size, r, PtValue::list(std::move(buffers)),
                                              PtValue::list(std::move(modules)), ddp_buckets ? *ddp_buckets : PtValue())}});
    writers.push_back(std::make_unique<checkpoint::PtWriter>(
        checkpoint::rank_file_path(out_prefix, ckpt_suffix, r, world_size)));
    writers.back()->begin(root);
  }
  // Each tensor streamed once, in order: rank r's file takes the bytes of
  // its rows (all of them for a tensor that is not sharded).
  size_t k = 0;
  const auto spread = [&](const LogicalTensor& t) {
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const int64_t row_bytes = rows > 0 ? t.bytes() / rows : 0;
    std::vector<std::pair<int64_t, int64_t>> range(static_cast<size_t>(world_size));  // [begin, end) bytes
    for (int r = 0; r < world_size; ++r) {
      int64_t first = 0;
      const int64_t n = rows_on(t, r, first);
      range[static_cast<size_t>(r)] = t.sharded ? std::make_pair(first * row_bytes, (first + n) * row_bytes)
                                                : std::make_pair(int64_t{0}, t.bytes());
      writers[static_cast<size_t>(r)]->begin_storage(keys[static_cast<size_t>(r)][k]);
    }
    int64_t at = 0;
    files.stream_full(t, [&](const char* data, size_t n) {
      const int64_t end = at + static_cast<int64_t>(n);
      for (int r = 0; r < world_size; ++r) {
        const auto [lo, hi] = range[static_cast<size_t>(r)];
        const int64_t from = std::max(lo, at), to = std::min(hi, end);
        if (from < to) writers[static_cast<size_t>(r)]->append(data + (from - at), static_cast<size_t>(to - from));
      }
      at = end;
    });
    for (auto& w : writers) w->end_storage();
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
  info.other_records = checkpoint::other_records(files);
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

}  // namespace tdist
