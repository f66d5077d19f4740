// A model and its optimizer saved as a DCP folder (dcp_save.h).
#include "checkpoint/dcp_save.h"

#include <ATen/ATen.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include "checkpoint/dcp_layout.h"
#include "formats/dcp_metadata.h"
#include "formats/dcp_writer.h"
#include "checkpoint/model_entries.h"
#include "checkpoint/optimizer_kinds.h"
#include "checkpoint/sharded_files.h"
#include "process_group/agree.h"
#include "tdist/errors.h"
#include "tdist/state_dict.h"

namespace tdist::checkpoint {

namespace {

using dcp::Item;
using Part = dcp::Item::Part;

using detail::first_failure;

// Where this rank's items went: the records rank 0 merges into the .metadata.
class RankPart {
 public:
  RankPart(const std::string& dir, const std::string& file) : w_(dir, file) {}

  // Every planned item written; a tensor written before (a tied one,
  // under another name) points at the same bytes.
  void write(const DcpRankContents& contents) {
    std::unordered_map<const c10::TensorImpl*, dcp::Storage> written;
    for (const DcpPlannedItem& p : contents.items) {
      Item it;
      it.fqn = p.fqn;
      it.path = p.path;
      if (!p.tensor.defined()) {
        it.bytes = w_.add_value(p.value);
        items_.push_back(std::move(it));
        continue;
      }
      it.tensor = true;
      it.dtype = p.tensor.scalar_type();
      it.size = p.size;
      dcp::Chunk c;
      c.offsets = p.offsets;
      c.sizes = p.tensor.sizes().vec();
      const auto seen = written.find(p.tensor.unsafeGetTensorImpl());
      if (seen != written.end()) {
        c.storage = seen->second;
      } else {
        const at::Tensor host = p.tensor.detach().to(at::kCPU).contiguous();
        w_.begin_tensor(host.scalar_type(), host.sizes().vec());
        w_.append(host.data_ptr(), host.nbytes());
        c.storage = w_.end_tensor();
        written.emplace(p.tensor.unsafeGetTensorImpl(), c.storage);
      }
      it.chunks.push_back(std::move(c));
      items_.push_back(std::move(it));
    }
  }
  DcpRankFileWriter& file() { return w_; }

  // The items as a pickled list (what rank 0 merges into the .metadata).
  std::string records() const {
    std::vector<PtValue> out;
    for (const Item& it : items_) {
      std::vector<PtValue> path;
      for (const Part& p : it.path) path.push_back(PtValue::tuple({PtValue::string(p.key), PtValue::boolean(p.index)}));
      const dcp::Storage& s = it.tensor ? it.chunks[0].storage : it.bytes;
      const auto ints = [](const std::vector<int64_t>& v) {
        std::vector<PtValue> x;
        for (int64_t i : v) x.push_back(PtValue::integer(i));
        return PtValue::tuple(std::move(x));
      };
      out.push_back(PtValue::tuple(
          {PtValue::string(it.fqn), PtValue::list(std::move(path)), PtValue::boolean(it.tensor),
           PtValue::integer(static_cast<int64_t>(it.dtype)), ints(it.size),
           ints(it.tensor ? it.chunks[0].offsets : std::vector<int64_t>{}),
           ints(it.tensor ? it.chunks[0].sizes : std::vector<int64_t>{}), PtValue::string(s.file),
           PtValue::integer(static_cast<int64_t>(s.offset)), PtValue::integer(static_cast<int64_t>(s.length))}));
    }
    return pickle_value(PtValue::list(std::move(out)));
  }

 private:
  DcpRankFileWriter w_;
  std::vector<Item> items_;
};

// Every rank's records merged, in rank 0's order (then any another rank
// adds), each tensor's chunks together.
dcp::Metadata merge(const std::vector<std::string>& records) {
  dcp::Metadata m;
  for (const std::string& bytes : records) {
    const PtValue rank_records = unpickle_value(bytes);
    for (const PtValue& r : rank_records.items()) {
      const auto& f = r.items();
      const std::string& fqn = f[0].as_string();
      auto at = m.by_fqn.find(fqn);
      if (at == m.by_fqn.end()) {
        Item it;
        it.fqn = fqn;
        for (const PtValue& p : f[1].items()) it.path.push_back({p.items()[0].as_string(), p.items()[1].as_bool()});
        it.tensor = f[2].as_bool();
        it.dtype = static_cast<c10::ScalarType>(f[3].as_int());
        for (const PtValue& x : f[4].items()) it.size.push_back(x.as_int());
        at = m.by_fqn.emplace(fqn, m.items.size()).first;
        m.items.push_back(std::move(it));
      }
      Item& it = m.items[at->second];
      const dcp::Storage s{f[7].as_string(), static_cast<uint64_t>(f[8].as_int()), static_cast<uint64_t>(f[9].as_int())};
      if (!it.tensor) {
        it.bytes = s;
        continue;
      }
      dcp::Chunk c;
      for (const PtValue& x : f[5].items()) c.offsets.push_back(x.as_int());
      for (const PtValue& x : f[6].items()) c.sizes.push_back(x.as_int());
      c.storage = s;
      it.chunks.push_back(std::move(c));
    }
  }
  return m;
}

std::vector<Part> parts(std::initializer_list<std::string> keys) {
  std::vector<Part> out;
  for (const auto& k : keys) out.push_back({k, false});
  return out;
}

}  // namespace

DcpRankContents build_dcp_rank(ProcessGroup& pg, torch::nn::Module& model, torch::optim::Optimizer* opt,
                               CopyPool* copies) {
  DcpRankContents out;
  const int rank = pg.rank();
  const auto fsdp = detail::FsdpModel::of(model);
  std::map<std::string, detail::FsdpParamRecord> units;
  if (fsdp) {
    for (const auto& u : fsdp->params()) units.emplace(u.name, u);
  }
  const auto keep = [&](const at::Tensor& t) { return copies ? copies->copy(t) : t; };
  const auto chunk = [&](const std::string& fqn, std::vector<Part> path, const at::Tensor& t,
                         std::vector<int64_t> size, std::vector<int64_t> offsets) {
    out.items.push_back({fqn, std::move(path), t, std::move(size), std::move(offsets), PtValue()});
  };
  // A tensor this rank writes: a sharded unit parameter's rows (or its
  // state's) where it has any; anything else on rank 0 only.
  const auto put = [&](const std::string& fqn, std::vector<Part> path, const at::Tensor& t, const std::string& param,
                       bool like_param) {
    const auto u = units.find(param);
    if (u != units.end() && u->second.sharded && like_param) {
      const detail::FsdpParamRecord& r = u->second;
      if (r.rows == 0) return;  // none of its rows here
      std::vector<int64_t> offsets(r.full_shape.size(), 0);
      if (!offsets.empty()) offsets[0] = r.first_row;
      return chunk(fqn, std::move(path), t, r.full_shape, offsets);
    }
    if (rank == 0) chunk(fqn, std::move(path), t, t.sizes().vec(), std::vector<int64_t>(t.dim(), 0));
  };
  const ShardedStateDict local = sharded_state_dict(model);
  for (const auto& e : unique_entries_of(model)) {
    const at::Tensor t = keep(local.tensors[e.name]);  // one copy, for every name it has
    put("model." + e.name, parts({"model", e.name}), t, e.name, true);
    for (const auto& a : e.aliases) put("model." + a, parts({"model", a}), t, e.name, true);
  }
  if (opt == nullptr) return out;
  const OptimizerStateDict o = sharded_optimizer_state_dict(model, *opt);
  for (const auto& p : o.state) {
    const auto u = units.find(p.key());
    for (const auto& f : p.value()) {
      const std::string fqn = "optim.state." + p.key() + "." + f.key();
      std::vector<Part> path = parts({"optim", "state", p.key(), f.key()});
      if (f.key() == "step") {  // PyTorch keeps it as a float32 0-d tensor
        if (rank == 0) chunk(fqn, std::move(path), f.value().to(at::kFloat), {}, {});
        continue;
      }
      // State shaped like its parameter is sharded like it.
      const bool like = u != units.end() && u->second.sharded &&
                        (u->second.rows == 0 || f.value().sizes().vec() == rows_shape(u->second.full_shape, u->second.rows));
      put(fqn, std::move(path), keep(f.value()), p.key(), like);
    }
  }
  if (rank != 0) return out;
  const auto value = [&](const std::string& fqn, std::vector<Part> path, PtValue v) {
    out.items.push_back({fqn, std::move(path), at::Tensor(), {}, {}, std::move(v)});
  };
  for (size_t g = 0; g < o.param_groups.size(); ++g) {
    const std::string gi = std::to_string(g);
    const auto path = [&](const std::string& key) {
      return std::vector<Part>{{"optim", false}, {"param_groups", false}, {gi, true}, {key, false}};
    };
    for (const auto& [key, v] : dcp::python_options(o.optimizer, o.param_groups[g].options)) {
      value("optim.param_groups." + gi + "." + key, path(key), v);
    }
    std::vector<PtValue> names;
    for (const auto& n : o.param_groups[g].params) names.push_back(PtValue::string(n));
    value("optim.param_groups." + gi + ".params", path("params"), PtValue::list(std::move(names)));
  }
  return out;
}

void commit_dcp(const std::string& dir, ProcessGroup& pg, const DcpRankContents* contents, std::string error,
                std::chrono::milliseconds timeout, const DcpWriteRunner& run_write) {
  const char* what = "save as DCP";
  const DcpWriteRunner run = run_write ? run_write : [](const std::function<void()>& work) { work(); };
  int64_t k = 0;
  std::string mine = error;
  error.clear();
  if (pg.rank() == 0) {
    try {
      ::mkdir(dir.c_str(), 0755);
      struct stat st {};
      if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw CheckpointError(dir + ": not a directory");
      k = fresh_file_index(dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  std::string failed = first_failure(pg, error, timeout);
  if (!failed.empty()) throw CheckpointError(std::string(what) + " " + dir + ": " + failed);
  k = detail::rank0_value(pg, k, timeout);
  std::optional<RankPart> part;
  std::string records;
  error = mine;
  if (error.empty()) {
    try {
      run([&] {
        part.emplace(dir, "__" + std::to_string(pg.rank()) + "_" + std::to_string(k) + ".distcp");
        part->write(*contents);
        part->file().sync();
      });
      records = part->records();
    } catch (const std::exception& e) {
      error = *e.what() ? e.what() : "an error without words";
    }
  }
  failed = first_failure(pg, error, timeout);
  if (!failed.empty()) throw CheckpointError(std::string(what) + " " + dir + ": " + failed + " (nothing was replaced)");
  const std::vector<std::string> all = detail::all_gather_bytes(pg, records, timeout);
  std::optional<AtomicFileWriter> metadata;
  dcp::Metadata m;
  if (pg.rank() == 0) {
    try {
      m = merge(all);
      const std::string bytes = dcp::pickle_metadata(m);
      dcp::parse_metadata(bytes, dir);  // what a reader will check: every chunk there, none overlapping
      metadata.emplace(dir + "/" + dcp::kMetadataFile);
      metadata->write(bytes.data(), bytes.size());
      metadata->sync();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  failed = first_failure(pg, error, timeout);
  if (!failed.empty()) throw CheckpointError(std::string(what) + " " + dir + ": " + failed + " (nothing was replaced)");
  try {
    run([&] { part->file().commit(); });
  } catch (const std::exception& e) {
    error = e.what();
  }
  failed = first_failure(pg, error, timeout);
  if (!failed.empty()) {
    throw CheckpointError(std::string(what) + " " + dir + ": " + failed + " (the previous .metadata stands)");
  }
  if (pg.rank() == 0) {
    try {
      metadata->commit();  // the save is in place
      remove_stale_files(dir, m);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  failed = first_failure(pg, error, timeout);
  if (!failed.empty()) throw CheckpointError(std::string(what) + " " + dir + ": " + failed);
}

void save_dcp(const std::string& dir, ProcessGroup& pg, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
              std::chrono::milliseconds timeout) {
  std::optional<DcpRankContents> contents;
  std::string error;
  try {
    contents.emplace(build_dcp_rank(pg, model, optimizer, nullptr));
  } catch (const std::exception& e) {
    error = *e.what() ? e.what() : "an error without words";
  }
  commit_dcp(dir, pg, contents ? &*contents : nullptr, error, timeout);
}

}  // namespace tdist::checkpoint
