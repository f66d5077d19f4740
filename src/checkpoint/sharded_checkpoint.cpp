// Per-rank checkpoint files: save and load (at the saving world size from
// the rank's own file, at another from the rows the files hold). The
// contract is in include/tdist/sharded_checkpoint.h; the files' layout in
// checkpoint_tree.h.
#include "tdist/sharded_checkpoint.h"

#include <ATen/ATen.h>
#include <sys/stat.h>

#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <unistd.h>

#include "checkpoint/tensor_tree.h"
#include "checkpoint/load_checks.h"
#include "checkpoint/model_entries.h"
#include "checkpoint/sharded_files.h"
#include "checkpoint/sharded_tensors.h"

namespace tdist {

namespace {

using checkpoint::PtReader;
using checkpoint::PtTensorRef;
using checkpoint::PtValue;
using checkpoint::PtWriter;

void check_group(const char* what, ProcessGroup& pg, torch::nn::Module& model) {
  if (const auto units = detail::units_group(model)) {
    if (units->size() != pg.size() || units->rank() != pg.rank()) {
      throw UsageError(std::string(what) + ": the model's FSDP group is rank " + std::to_string(units->rank()) +
                       " of " + std::to_string(units->size()) + ", the group given rank " +
                       std::to_string(pg.rank()) + " of " + std::to_string(pg.size()) + ": pass the model's group");
    }
  }
}

// Every rank says how its part went ("" when well); the first failing
// rank's words (every rank gets the same), or "" when all went well. A
// rank that never answers (dead, stuck) is the collective's timeout error.
std::string first_error(const char* what, ProcessGroup& pg, const std::string& mine,
                        std::chrono::milliseconds timeout) {
  constexpr int64_t kBytes = 1024;
  at::Tensor own = at::zeros({kBytes}, at::kByte);
  std::memcpy(own.data_ptr(), mine.data(), std::min<size_t>(mine.size(), kBytes - 1));
  at::Tensor all = at::empty({pg.size(), kBytes}, at::kByte);
  try {
    CollectiveOptions o;
    o.timeout = timeout;
    pg.all_gather_into_tensor(all, own, o)->wait();
  } catch (const Error& e) {
    throw CheckpointError(std::string(what) + ": rank " + std::to_string(pg.rank()) +
                          " did not hear from every rank (nothing was replaced or loaded): " + e.what());
  }
  for (int r = 0; r < pg.size(); ++r) {
    const char* text = static_cast<const char*>(all[r].data_ptr());
    if (text[0] != 0) return "rank " + std::to_string(r) + ": " + std::string(text, strnlen(text, kBytes));
  }
  return "";
}

int64_t agreed_save_id(ProcessGroup& pg, std::chrono::milliseconds timeout) {
  at::Tensor id = at::zeros({1}, at::kLong);
  if (pg.rank() == 0) {
    std::random_device rd;
    id[0] = static_cast<int64_t>((static_cast<uint64_t>(rd()) << 31) ^ rd()) & INT64_MAX;
  }
  BroadcastOptions o;
  o.timeout = timeout;
  pg.broadcast(id, o)->wait();
  return id.item<int64_t>();
}

std::string archive_bytes(const PowerSGDState& state) {
  torch::serialize::OutputArchive archive;
  state.save(archive);
  std::string bytes;
  archive.save_to([&](const void* data, size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  return bytes;
}

// What a load reads before it changes anything.
struct Staged {
  ShardedStateDict model;
  std::optional<OptimizerStateDict> optimizer;
  std::string comm_hook;
  std::optional<std::vector<std::vector<size_t>>> ddp_buckets;
};

detail::DataParallel* ddp_of(torch::nn::Module& model) {
  auto* m = dynamic_cast<detail::DataParallelModule*>(&model);
  return m ? &m->data_parallel() : nullptr;
}

// DDP's bucket layout once rebuilt (parameter indices per bucket), so that
// a resumed run buckets its gradients alike (a hook's state is per bucket).
PtValue ddp_buckets_value(torch::nn::Module& model) {
  detail::DataParallel* ddp = ddp_of(model);
  if (!ddp || !ddp->buckets_rebuilt()) return PtValue();
  std::vector<PtValue> buckets;
  for (const auto& b : ddp->bucket_indices()) {
    std::vector<PtValue> ks;
    for (const size_t k : b) ks.push_back(PtValue::integer(static_cast<int64_t>(k)));
    buckets.push_back(PtValue::list(std::move(ks)));
  }
  return PtValue::list(std::move(buckets));
}

std::optional<std::vector<std::vector<size_t>>> ddp_buckets_from(const PtValue& tag) {
  const PtValue* v = tag.find("ddp_buckets");
  if (!v || v->is_none()) return std::nullopt;
  std::vector<std::vector<size_t>> out;
  for (const auto& b : v->items()) {
    out.emplace_back();
    for (const auto& k : b.items()) {
      if (k.as_int() < 0) throw CheckpointError("a negative parameter index in ddp_buckets");
      out.back().push_back(static_cast<size_t>(k.as_int()));
    }
  }
  return out;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The rank's own file, when it holds this model's layout (the same world
// size, rank and shards); else nothing.
std::optional<Staged> stage_own(const std::string& path, ProcessGroup& pg, torch::nn::Module& model,
                                bool want_optimizer, int64_t& save_id) {
  if (!exists(path)) return std::nullopt;
  PtReader reader(path);
  const PtValue& root = reader.root();
  const PtValue& tag = checkpoint::field(root, "tdist", path);
  ShardMetadata saved = checkpoint::metadata_from(checkpoint::field(root, "shard_metadata", path));
  const bool fsdp = detail::units_group(model) != nullptr;
  const ShardMetadata now = fsdp ? detail::shard_metadata(model) : ShardMetadata{};
  if (tag.at("kind").as_string() != "sharded" || saved.world_size != pg.size() || saved.rank != pg.rank()) {
    return std::nullopt;
  }
  if (tag.at("format").as_int() != checkpoint::kFormatVersion) {
    throw CheckpointError(path + ": format " + std::to_string(tag.at("format").as_int()) + ", this tdist reads " +
                          std::to_string(checkpoint::kFormatVersion));
  }
  // The same shards: every unit parameter with the same rows here.
  std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t>> a, b;
  for (const auto& u : saved.units) {
    for (const auto& p : u.params) a.emplace_back(p.original_name, p.shard_shape, u.sharded ? p.first_row : -1);
  }
  for (const auto& u : now.units) {
    for (const auto& p : u.params) b.emplace_back(p.original_name, p.shard_shape, u.sharded ? p.first_row : -1);
  }
  if (a != b) return std::nullopt;
  save_id = tag.at("save_id").as_int();
  Staged s;
  s.ddp_buckets = ddp_buckets_from(tag);
  const auto read = [&](const PtTensorRef& ref) {
    checkpoint::check_whole(ref, path, "storage " + ref.storage_key);  // nothing sized by a stride of 0
    return reader.read_tensor(ref);
  };
  for (const auto& [name, v] : checkpoint::field(root, "model", path).entries()) {
    s.model.tensors.insert(name, read(v.as_tensor()));
  }
  s.model.metadata = fsdp ? now : ShardMetadata{};
  const PtValue& opt = checkpoint::field(root, "optimizer", path);
  if (want_optimizer) {
    if (opt.is_none()) throw CheckpointError(path + ": the checkpoint holds no optimizer state");
    s.optimizer = checkpoint::optimizer_from(opt, read);
    s.optimizer->world_size = fsdp ? pg.size() : 1;
    s.optimizer->rank = fsdp ? pg.rank() : 0;
  }
  const PtValue* hook = root.find("comm_hook");
  if (hook && !hook->is_none()) {
    const at::Tensor bytes = read(hook->as_tensor());
    s.comm_hook.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
  }
  return s;
}

// This rank's rows of everything, from the files of another world size
// or layout.
Staged stage_resharded(const std::string& prefix, const ShardedCheckpointOptions& options, ProcessGroup& pg,
                       torch::nn::Module& model, bool want_optimizer, int64_t& save_id) {
  checkpoint::ShardedCheckpointFiles files(prefix, options.suffix);
  save_id = files.save_id();
  Staged s;
  s.ddp_buckets = ddp_buckets_from(files.reader(0).root().at("tdist"));
  const std::string where = "the checkpoint " + prefix + options.suffix;
  if (options.comm_hook_state) {
    throw CheckpointError(where + " was saved by " + std::to_string(files.world_size()) + " ranks in another layout: " +
                          "a comm hook's state resumes only from each rank's own file (the same world size, " +
                          "now " + std::to_string(pg.size()) + ", and the same sharding)");
  }
  const bool fsdp = detail::units_group(model) != nullptr;
  std::map<std::string, detail::UnitParam> units;  // by name
  for (auto& [impl, u] : checkpoint::units_of(model)) units.emplace(u.original_name, u);
  std::map<std::string, const checkpoint::LogicalTensor*> saved;
  for (const auto& t : files.model()) saved[t.name] = &t;
  s.model.metadata = fsdp ? detail::shard_metadata(model) : ShardMetadata{};
  std::set<std::string> names;
  for (const auto& e : checkpoint::entries_of(model)) {
    names.insert(e.name);
    const auto it = saved.find(e.name);
    if (it == saved.end()) throw CheckpointError(where + " has no '" + e.name + "'");
    const auto u = units.find(e.name);
    const std::vector<int64_t> full = u != units.end() ? u->second.full_shape : e.tensor.sizes().vec();
    if (it->second->shape != full) {
      throw CheckpointError(where + ": '" + e.name + "' is " + checkpoint::shape_string(it->second->shape) +
                            " there but " + checkpoint::shape_string(full) + " in the model");
    }
    s.model.tensors.insert(e.name, u != units.end() && u->second.sharded
                                       ? checkpoint::read_rows(files, *it->second, u->second.first_row, u->second.rows)
                                       : checkpoint::read_full(files, *it->second));
  }
  for (const auto& t : files.model()) {
    if (!names.count(t.name)) throw CheckpointError(where + ": its '" + t.name + "' is not in the model");
  }
  if (want_optimizer) {
    if (!files.has_optimizer()) throw CheckpointError(where + " holds no optimizer state");
    OptimizerStateDict o = checkpoint::optimizer_from(files.optimizer_tree(), [](const PtTensorRef&) {
      return at::Tensor();  // filled below, by rows
    });
    o.world_size = fsdp ? pg.size() : 1;
    o.rank = fsdp ? pg.rank() : 0;
    for (const auto& t : files.optimizer()) {
      const auto u = units.find(t.param);
      // This rank's rows of state shaped like its parameter (a whole
      // parameter's state from a checkpoint without sharding too).
      const bool rows = u != units.end() && u->second.sharded && t.field != "step" && t.shape == u->second.full_shape;
      o.state[t.param][t.field] = rows ? checkpoint::read_rows(files, t, u->second.first_row, u->second.rows)
                                         : checkpoint::read_full(files, t);
    }
    s.optimizer = std::move(o);
  }
  return s;
}

// Builds and writes (not syncs) this rank's file.
void write_rank_file(PtWriter& writer, ProcessGroup& pg, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                     const ShardedCheckpointOptions& options, int64_t save_id) {
  ShardedStateDict local = sharded_state_dict(model);
  local.metadata.world_size = pg.size();
  local.metadata.rank = pg.rank();
  checkpoint::TensorSink sink;
  std::vector<std::pair<std::string, PtValue>> tensors;
  for (const auto& item : local.tensors) tensors.emplace_back(item.key(), sink.add(item.value()));
  std::vector<PtValue> buffers, modules;
  for (const auto& e : checkpoint::entries_of(model)) {
    if (!e.parameter) buffers.push_back(PtValue::string(e.name));
  }
  for (const auto& m : checkpoint::module_names(model)) modules.push_back(PtValue::string(m));
  PtValue opt;
  if (optimizer) {
    OptimizerStateDict o = sharded_optimizer_state_dict(model, *optimizer);
    o.world_size = pg.size();
    o.rank = pg.rank();
    opt = checkpoint::optimizer_value(o, sink);
  }
  PtValue hook;
  if (options.comm_hook_state) {
    const std::string bytes = archive_bytes(*options.comm_hook_state);
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    hook = sink.add(t);
  }
  const PtValue root = PtValue::dict(
      {{"model", PtValue::dict(std::move(tensors))},
       {"shard_metadata", checkpoint::metadata_value(local.metadata)},
       {"optimizer", std::move(opt)},
       {"comm_hook", std::move(hook)},
       {"tdist", PtValue::dict({{"format", PtValue::integer(checkpoint::kFormatVersion)},
                                {"kind", PtValue::string("sharded")},
                                {"save_id", PtValue::integer(save_id)},
                                {"world_size", PtValue::integer(pg.size())},
                                {"rank", PtValue::integer(pg.rank())},
                                {"buffers", PtValue::list(std::move(buffers))},
                                {"modules", PtValue::list(std::move(modules))},
                                {"ddp_buckets", ddp_buckets_value(model)}})}});
  sink.write(writer, root);
}

}  // namespace

void save_sharded_checkpoint(const std::string& prefix, ProcessGroup& pg, torch::nn::Module& model,
                             torch::optim::Optimizer* optimizer, const ShardedCheckpointOptions& options) {
  const char* what = "save_sharded_checkpoint";
  const int64_t save_id = agreed_save_id(pg, options.timeout);
  std::optional<PtWriter> writer;
  std::string error;
  try {
    check_group(what, pg, model);
    writer.emplace(checkpoint::rank_file_path(prefix, options.suffix, pg.rank(), pg.size()));
    write_rank_file(*writer, pg, model, optimizer, options, save_id);
    writer->sync();
  } catch (const std::exception& e) {
    error = *e.what() ? e.what() : "an error without words";
  }
  const std::string failed = first_error(what, pg, error, options.timeout);
  if (!failed.empty()) throw CheckpointError(std::string(what) + ": " + failed + " (no file was replaced)");
  try {
    writer->commit();
  } catch (const std::exception& e) {
    error = *e.what() ? e.what() : "the rename failed";
  }
  const std::string renamed = first_error(what, pg, error, options.timeout);
  if (!renamed.empty()) {
    throw CheckpointError(std::string(what) + ": " + renamed + ", after other ranks had renamed theirs: the files " +
                          "under " + prefix + " are from two saves now, which every load refuses; save again");
  }
  // Files of another world size under this prefix are an older save's:
  // rank 0 removes them (a load refuses a prefix holding two world sizes).
  if (pg.rank() == 0) {
    for (const auto& f : checkpoint::find_rank_files(prefix, options.suffix)) {
      if (f.world_size >= 0 && f.world_size != pg.size()) ::unlink(f.path.c_str());
    }
  }
  first_error(what, pg, "", options.timeout);  // every file in place when any rank returns
}

void load_sharded_checkpoint(const std::string& prefix, ProcessGroup& pg, torch::nn::Module& model,
                             torch::optim::Optimizer* optimizer, const ShardedCheckpointOptions& options) {
  const char* what = "load_sharded_checkpoint";
  std::optional<Staged> staged;
  int64_t save_id = 0;
  std::string error;
  detail::DataParallel* ddp = ddp_of(model);
  try {
    check_group(what, pg, model);
    std::map<int64_t, std::string> worlds;
    for (const auto& f : checkpoint::find_rank_files(prefix, options.suffix)) {
      if (f.world_size >= 0) worlds.emplace(f.world_size, f.path);
    }
    if (worlds.size() > 1) {
      throw CheckpointError("files of different world sizes under " + prefix + ": " + worlds.begin()->second +
                            " and " + worlds.rbegin()->second + " (remove the older save's)");
    }
    const std::string own = checkpoint::rank_file_path(prefix, options.suffix, pg.rank(), pg.size());
    staged = stage_own(own, pg, model, optimizer != nullptr, save_id);
    if (!staged) staged = stage_resharded(prefix, options, pg, model, optimizer != nullptr, save_id);
    // Every part checked before any is applied.
    checkpoint::check_sharded_model_state(model, staged->model);
    if (ddp && staged->ddp_buckets) {
      try {
        ddp->check_bucket_indices(*staged->ddp_buckets);
      } catch (const UsageError& e) {
        throw CheckpointError(std::string("the checkpoint's DDP buckets do not fit this model: ") + e.what());
      }
    }
    if (optimizer) checkpoint::check_sharded_optimizer_state(model, *optimizer, *staged->optimizer);
    if (options.comm_hook_state) {  // on a probe
      if (staged->comm_hook.empty()) throw CheckpointError("the checkpoint holds no comm hook state");
      PowerSGDState probe(nullptr, options.comm_hook_state->options());
      torch::serialize::InputArchive archive;
      archive.load_from(staged->comm_hook.data(), staged->comm_hook.size());
      probe.load(archive);
    }
  } catch (const std::exception& e) {
    error = *e.what() ? e.what() : "an error without words";
  }
  const std::string failed = first_error(what, pg, error, options.timeout);
  if (!failed.empty()) throw CheckpointError(std::string(what) + ": " + failed + " (nothing was loaded)");
  // Every rank read the same save (its own files can be from different ones
  // when a save was cut short between renames).
  at::Tensor ids = at::full({2}, save_id, at::kLong);
  ids[1] = -save_id;
  AllreduceOptions o;
  o.op = ReduceOp::MAX;
  o.timeout = options.timeout;
  pg.all_reduce(ids, o)->wait();
  if (ids[0].item<int64_t>() != -ids[1].item<int64_t>()) {
    throw CheckpointError(std::string(what) + ": the ranks' files of " + prefix + options.suffix +
                          " come from different saves (one that did not finish?); nothing was loaded");
  }
  load_sharded_state_dict(model, staged->model);
  if (ddp && staged->ddp_buckets) ddp->set_bucket_indices(*staged->ddp_buckets);
  if (optimizer) load_sharded_optimizer_state_dict(model, *optimizer, *staged->optimizer);
  if (options.comm_hook_state) {
    torch::serialize::InputArchive archive;
    archive.load_from(staged->comm_hook.data(), staged->comm_hook.size());
    options.comm_hook_state->load(archive);
  }
}

}  // namespace tdist
