// load_pretrained and save_pretrained. The contract is in
// include/tdist/pretrained.h; the files read are resolved and opened by
// pretrained_sources.h.
#include "tdist/pretrained.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <sys/stat.h>
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <unordered_map>

#include "checkpoint/checkpoint_tree.h"
#include "formats/file_io.h"
#include "checkpoint/model_entries.h"
#include "checkpoint/pretrained_sources.h"
#include "tdist/safetensors.h"
#include "fsdp/fsdp_model.h"
#include "tdist/fsdp.h"
#include "tdist/process_group.h"
#include "util/printable.h"

namespace tdist {

namespace {

using checkpoint::Entry;
using checkpoint::PretrainedSources;
using checkpoint::shape_string;
using checkpoint::SourceTensor;
using checkpoint::Units;

// The full shape of an entry (an FSDP unit's parameter: the whole one).
std::vector<int64_t> full_shape(const Entry& e, const Units& units) {
  const auto it = units.find(e.tensor.unsafeGetTensorImpl());
  return it != units.end() ? it->second.full_shape : e.tensor.sizes().vec();
}

// The keys a model name may have in a file: itself, and with the base
// model's prefix taken off or put on.
std::vector<std::string> keys_for(const std::string& name, const std::string& prefix) {
  std::vector<std::string> out{name};
  if (prefix.empty()) return out;
  const std::string p = prefix + ".";
  out.push_back(name.rfind(p, 0) == 0 ? name.substr(p.size()) : p + name);
  return out;
}

// A file's values convert into the model's tensor: the same dtype, or both
// floating point (fp32, fp16, bf16, fp64), or both integers.
bool convertible(at::ScalarType from, at::ScalarType to) {
  if (from == at::ScalarType::Undefined) return false;
  if (from == to) return true;
  if (at::isFloatingType(from) && at::isFloatingType(to)) return true;
  const auto integral = [](at::ScalarType t) { return at::isIntegralType(t, /*includeBool=*/false); };
  return integral(from) && integral(to);
}

std::string also(const Entry& e) {
  if (e.aliases.empty()) return "";
  std::string s = " (tied:";
  for (const auto& a : e.aliases) s += " '" + a + "'";
  return s + ")";
}

constexpr size_t kMaxMatchedKey = 1024;

// Each entry's tensor in the files (null: missing), checked: shapes equal,
// dtypes convertible, every key used or skipped (with strict).
std::vector<const SourceTensor*> match(const std::vector<Entry>& entries, const Units& units,
                                       const PretrainedSources& files, const LoadPretrainedOptions& options,
                                       LoadPretrainedReport& report) {
  std::vector<std::regex> ignore;
  for (const auto& r : options.ignore_unexpected) {
    try {
      ignore.emplace_back(r, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw UsageError("load_pretrained: ignore_unexpected '" + r + "' is not a regular expression: " + e.what());
    }
  }
  std::vector<const SourceTensor*> out;
  std::set<const SourceTensor*> used;
  for (const auto& e : entries) {
    const std::vector<int64_t> want = full_shape(e, units);
    const SourceTensor* found = nullptr;
    std::vector<std::string> names{e.name};
    names.insert(names.end(), e.aliases.begin(), e.aliases.end());
    for (const auto& n : names) {
      for (const auto& k : keys_for(n, options.base_model_prefix)) {
        const SourceTensor* t = files.find(k);
        if (!t) continue;
        const std::string& file = files.files()[t->file];
        if (t->shape != want) {
          throw CheckpointError("load_pretrained: " + file + ": '" + detail::printable(k) + "' is " + shape_string(t->shape) +
                                " in the file but " + shape_string(want) + " in the model ('" + e.name + "')");
        }
        if (!convertible(t->dtype, e.tensor.scalar_type())) {
          throw CheckpointError("load_pretrained: " + file + ": '" + detail::printable(k) + "' is " + t->dtype_name +
                                ", which does not convert to the model's " +
                                std::string(c10::toString(e.tensor.scalar_type())) + " ('" + e.name + "')");
        }
        files.check(*t);
        used.insert(t);
        if (!found) found = t;
      }
    }
    if (!found) {
      if (options.strict) {
        throw CheckpointError("load_pretrained: " + files.where() + ": no tensor for the model's '" + e.name + "'" +
                              also(e) + (options.base_model_prefix.empty() ? "" : ", with or without the prefix '" +
                                                                                      options.base_model_prefix + ".'"));
      }
      report.missing.push_back(e.name);
    } else {
      report.loaded.push_back(e.name);
    }
    out.push_back(found);
  }
  for (const auto& t : files.tensors()) {
    if (used.count(&t)) continue;
    // std::regex recurses per character: a hostile key of megabytes would
    // overflow the stack, so keys past kMaxMatchedKey never match.
    bool skip = false;
    for (const auto& r : ignore) skip = skip || (t.key.size() <= kMaxMatchedKey && std::regex_match(t.key, r));
    if (!skip && options.strict) {
      throw CheckpointError("load_pretrained: " + files.files()[t.file] + ": '" + detail::printable(t.key) +
                            "' is not in the model (skip it with ignore_unexpected, or load with strict = false)");
    }
    report.ignored.push_back(t.key);
  }
  for (const auto& k : files.non_tensors()) report.ignored.push_back(k);
  return out;
}

}  // namespace

LoadPretrainedReport load_pretrained(torch::nn::Module& model, const std::string& path,
                                     const LoadPretrainedOptions& options) {
  const std::vector<Entry> entries = checkpoint::unique_entries_of(model);
  const auto fsdp = detail::FsdpModel::of(model);
  const Units units = checkpoint::units_of(fsdp);
  if (!units.empty()) fsdp->settle("load_pretrained");
  const PretrainedSources files(path);
  LoadPretrainedReport report;
  report.files = files.files();
  const std::vector<const SourceTensor*> sources = match(entries, units, files, options, report);
  // Everything checked: the model changes from here. (Corrupt data that
  // only reading finds, a CRC that does not match, is raised after the
  // entries before it were copied.)
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SourceTensor* src = sources[i];
    if (!src) continue;
    at::Tensor dst = entries[i].tensor;
    const auto u = units.find(dst.unsafeGetTensorImpl());
    if (u == units.end()) {
      dst.copy_(files.read(*src));
    } else if (u->second.full_shape.empty()) {
      dst.copy_(checkpoint::rows_of(files.read(*src), u->second));
    } else if (u->second.rows > 0) {
      dst.copy_(files.read_rows(*src, u->second.first_row, u->second.rows));
    } else {
      dst.zero_();  // no rows here: a write of nothing, so every rank counts it loaded (skip_init)
    }
  }
  return report;
}

// ---- save ---------------------------------------------------------------------------

namespace {

using Json = nlohmann::json;

void make_directory(const std::string& dir) {
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    partial = dir.substr(0, pos);
    if (partial.empty()) continue;
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      throw CheckpointError("save_pretrained: cannot create " + partial + " (" + std::strerror(errno) + ")");
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw CheckpointError("save_pretrained: " + dir + " is not a directory");
  }
}

void write_text(const std::string& path, const std::string& text) {
  checkpoint::AtomicFileWriter w(path);
  w.write(text.data(), text.size());
  w.commit();
}

// model-00001-of-00003.safetensors, as transformers names its shards.
std::string shard_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

bool is_shard_name(const std::string& name) {
  unsigned a = 0, b = 0;
  char tail[16] = {};
  return name.size() == shard_name(0, 1).size() &&
         std::sscanf(name.c_str(), "model-%5u-of-%5u.%12s", &a, &b, tail) == 3 && std::string(tail) == "safetensors";
}

// Files of an earlier save that the new one does not name: shards, and the
// index when there is now one file (a later load would prefer it).
void remove_stale(const std::string& dir, const std::set<std::string>& keep) {
  std::vector<std::string> stale;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (keep.count(name)) continue;
      if (is_shard_name(name) || name == "model.safetensors.index.json" || name == "model.safetensors") {
        stale.push_back(name);
      }
    }
    ::closedir(d);
  }
  for (const auto& name : stale) ::unlink((dir + "/" + name).c_str());
}

// Rank 0's words ("" when all went well) on every rank.
std::string rank0_outcome(ProcessGroup& pg, const std::string& mine) {
  constexpr int64_t kBytes = 1024;
  at::Tensor t = at::zeros({kBytes}, at::kByte);
  if (pg.rank() == 0) std::memcpy(t.data_ptr(), mine.data(), std::min<size_t>(mine.size(), kBytes - 1));
  pg.broadcast(t)->wait();
  const char* text = static_cast<const char*>(t.data_ptr());
  return std::string(text, strnlen(text, kBytes));
}

}  // namespace

void save_pretrained(torch::nn::Module& model, const std::string& dir, const SavePretrainedOptions& options) {
  if (options.max_shard_size <= 0) throw UsageError("save_pretrained: max_shard_size must be positive");
  std::vector<Entry> entries;
  {
    const std::set<std::string> skip(options.skip.begin(), options.skip.end());
    for (auto& e : checkpoint::unique_entries_of(model)) {
      if (!skip.count(e.name)) entries.push_back(std::move(e));
    }
  }
  const auto fsdp = detail::FsdpModel::of(model);
  const Units units = checkpoint::units_of(fsdp);
  const auto pg = fsdp ? fsdp->world_group() : nullptr;  // hybrid sharding: one writer over every replica
  if (!units.empty()) fsdp->settle("save_pretrained");
  const bool writes = !pg || pg->rank() == 0;

  // Each entry's file, in the model's order: a shard holds at most
  // max_shard_size bytes (one larger tensor a shard of its own).
  std::unordered_map<const c10::TensorImpl*, at::ScalarType> buffer_dtypes;
  if (fsdp) buffer_dtypes = fsdp->converted_buffers();
  std::vector<SafetensorsTensorInfo> infos;
  std::vector<size_t> file_of;
  size_t files = 0;
  int64_t in_file = 0, total = 0;
  for (const auto& e : entries) {
    const auto bd = buffer_dtypes.find(e.tensor.unsafeGetTensorImpl());
    const at::ScalarType dtype = bd != buffer_dtypes.end() ? bd->second : e.tensor.scalar_type();
    SafetensorsTensorInfo info{e.name, dtype, full_shape(e, units)};
    int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
    for (const int64_t d : info.shape) bytes *= d;
    if (files == 0 || (in_file > 0 && in_file + bytes > options.max_shard_size)) {
      ++files;
      in_file = 0;
    }
    in_file += bytes;
    total += bytes;
    infos.push_back(std::move(info));
    file_of.push_back(files - 1);
  }
  if (files == 0) files = 1;  // a model without tensors: one empty file
  std::vector<std::string> names;
  for (size_t f = 0; f < files; ++f) names.push_back(files == 1 ? "model.safetensors" : shard_name(f, files));

  // Each file's tensors in the order they come: the units' parameters as
  // they are gathered (outermost unit first), then everything else.
  std::unordered_map<std::string, size_t> by_name;  // every name of an entry -> its position
  for (size_t i = 0; i < entries.size(); ++i) {
    by_name.emplace(entries[i].name, i);
    for (const auto& a : entries[i].aliases) by_name.emplace(a, i);
  }
  std::vector<size_t> order;
  std::vector<bool> gathered(entries.size(), false);
  static const std::vector<detail::FsdpParamRecord> kNone;
  const std::vector<detail::FsdpParamRecord>& units_in_order = fsdp ? fsdp->params() : kNone;  // outermost first
  for (const auto& u : units_in_order) {
    const auto it = by_name.find(u.name);
    if (it == by_name.end() || gathered[it->second]) continue;
    gathered[it->second] = true;
    order.push_back(it->second);
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!gathered[i]) order.push_back(i);
  }

  // Rank 0 keeps its first error and goes on gathering, so that the other
  // ranks' collectives complete; then every rank hears how it went.
  std::exception_ptr error;
  const auto attempt = [&](const std::function<void()>& fn) {
    if (error) return;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
  };
  std::vector<std::unique_ptr<SafetensorsWriter>> writers;
  if (writes) {
    attempt([&] {
      make_directory(dir);
      std::vector<std::vector<SafetensorsTensorInfo>> declared(files);
      for (const size_t i : order) declared[file_of[i]].push_back(infos[i]);
      for (size_t f = 0; f < files; ++f) {
        writers.push_back(std::make_unique<SafetensorsWriter>(dir + "/" + names[f], std::move(declared[f]),
                                                              std::map<std::string, std::string>{{"format", "pt"}}));
      }
    });
  }
  const auto write = [&](size_t i, const at::Tensor& t) {
    const at::Tensor cpu = t.detach().to(at::TensorOptions().device(at::kCPU).dtype(infos[i].dtype));
    writers[file_of[i]]->write(infos[i].name, cpu);
  };
  at::NoGradGuard no_grad;
  if (pg && !units.empty()) {
    fsdp->visit_gathered([&](const std::string& name, const at::Tensor& full) {
      if (!writes) return;
      const auto it = by_name.find(name);
      if (it == by_name.end() || !gathered[it->second]) return;
      attempt([&] { write(it->second, full); });
    });
  }
  if (writes) {
    attempt([&] {
      for (const size_t i : order) {
        if (!gathered[i]) write(i, entries[i].tensor);
      }
      for (auto& w : writers) w->finish();
      if (files > 1) {
        Json index;
        index["metadata"]["total_size"] = total;
        index["weight_map"] = Json::object();
        for (size_t i = 0; i < entries.size(); ++i) index["weight_map"][entries[i].name] = names[file_of[i]];
        write_text(dir + "/model.safetensors.index.json", index.dump(2) + "\n");
      }
      std::set<std::string> keep(names.begin(), names.end());
      if (files > 1) keep.insert("model.safetensors.index.json");
      remove_stale(dir, keep);
      if (!options.config_json.empty()) write_text(dir + "/config.json", options.config_json);
    });
  }
  if (pg && !units.empty()) {
    // Every rank returns once the files are in place, or throws rank 0's error.
    std::string mine;
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        mine = e.what();
      } catch (...) {
        mine = "an unknown error";
      }
      if (mine.empty()) mine = "an error without a message";
    }
    const std::string outcome = rank0_outcome(*pg, mine);
    if (!outcome.empty() && !error) throw CheckpointError("save_pretrained: rank 0 failed: " + outcome);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace tdist
