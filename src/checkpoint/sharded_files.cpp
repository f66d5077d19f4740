// A sharded checkpoint's files read together; the contract is in
// sharded_files.h.
#include "checkpoint/sharded_files.h"

#include <dirent.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <set>

#include "checkpoint/checkpoint_tree.h"
#include "formats/file_io.h"
#include "tdist/errors.h"

namespace tdist::checkpoint {

namespace {

std::string base_of(const std::string& prefix) {
  const size_t slash = prefix.rfind('/');
  return slash == std::string::npos ? prefix : prefix.substr(slash + 1);
}

// Matches `name` against the pattern (each '*' one or more digits);
// the numbers it matched, or false.
bool match_digits(const std::string& pattern, const std::string& name, std::vector<int64_t>& numbers) {
  size_t n = 0;
  for (size_t p = 0; p < pattern.size(); ++p) {
    if (pattern[p] != '*') {
      if (n >= name.size() || name[n] != pattern[p]) return false;
      ++n;
      continue;
    }
    const size_t start = n;
    while (n < name.size() && std::isdigit(static_cast<unsigned char>(name[n])) && n - start < 9) ++n;
    if (n == start) return false;
    numbers.push_back(std::stoll(name.substr(start, n - start)));
  }
  return n == name.size();
}


int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) throw CheckpointError("a shape that is negative or overflows");
  }
  return n;
}

}  // namespace

void check_whole(const PtTensorRef& ref, const std::string& path, const std::string& name) {
  bool contiguous = ref.storage_offset == 0;
  int64_t expected = 1;
  for (size_t d = ref.sizes.size(); contiguous && d-- > 0;) {
    if (ref.sizes[d] < 0) contiguous = false;
    if (ref.sizes[d] > 1 && ref.strides[d] != expected) contiguous = false;
    if (contiguous && __builtin_mul_overflow(expected, std::max<int64_t>(ref.sizes[d], 1), &expected)) contiguous = false;
  }
  if (!contiguous || ref.sizes.size() != ref.strides.size() || ref.storage_numel != numel_of(ref.sizes)) {
    throw CheckpointError(path + ": '" + name + "' is not a whole, contiguous storage (what tdist writes)");
  }
}

std::vector<int64_t> rows_shape(const std::vector<int64_t>& full, int64_t rows) {
  if (full.empty()) return rows ? std::vector<int64_t>{} : std::vector<int64_t>{0};
  std::vector<int64_t> s = full;
  s[0] = rows;
  return s;
}

int64_t LogicalTensor::bytes() const {
  return numel_of(shape) * static_cast<int64_t>(c10::elementSize(dtype));
}

std::string rank_file_path(const std::string& prefix, const std::string& suffix, int rank, int world_size) {
  std::string out = prefix;
  int star = 0;
  for (const char c : suffix) {
    if (c == '*') {
      out += std::to_string(star++ == 0 ? rank : world_size);
    } else {
      out += c;
    }
  }
  if (star == 0 || star > 2) {
    throw UsageError("checkpoint suffix '" + suffix + "': give one '*' for the rank and one for the world size");
  }
  return out;
}

static void check_suffix(const std::string& suffix) {
  const size_t stars = static_cast<size_t>(std::count(suffix.begin(), suffix.end(), '*'));
  bool ok = stars >= 1 && stars <= 2 && suffix[0] != '*';
  for (size_t i = 0; ok && i + 1 < suffix.size(); ++i) {
    ok = !(suffix[i] == '*' && (suffix[i + 1] == '*' || std::isdigit(static_cast<unsigned char>(suffix[i + 1]))));
  }
  if (!ok) {
    throw UsageError("checkpoint suffix '" + suffix + "': give one '*' for the rank and one for the world size, "
                     "each after a character and before a non-digit (like \"_rank-*-of-*.pt\")");
  }
}

std::vector<RankFile> find_rank_files(const std::string& prefix, const std::string& suffix) {
  check_suffix(suffix);
  const std::string dir = directory_of(prefix), base = base_of(prefix);
  std::vector<RankFile> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.compare(0, base.size(), base) != 0) continue;
      std::vector<int64_t> numbers;
      if (!match_digits(suffix, name.substr(base.size()), numbers)) continue;
      out.push_back({numbers[0], numbers.size() > 1 ? numbers[1] : -1, dir + "/" + name});
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end(), [](const RankFile& x, const RankFile& y) { return x.path < y.path; });
  return out;
}

bool is_rank_file_name(const std::string& prefix, const std::string& suffix, const std::string& path) {
  check_suffix(suffix);
  const std::string base = base_of(prefix), name = name_of(path);
  std::vector<int64_t> numbers;
  return name.compare(0, base.size(), base) == 0 && match_digits(suffix, name.substr(base.size()), numbers) &&
         directory_of(resolve_directory(prefix)) == directory_of(resolve_directory(path));
}

ShardedCheckpointFiles::ShardedCheckpointFiles(const std::string& prefix, const std::string& suffix) {
  const std::vector<RankFile> found = find_rank_files(prefix, suffix);
  if (found.empty()) throw CheckpointError("no checkpoint files " + prefix + suffix);
  std::map<int64_t, std::string> worlds;  // world size -> a file saying it
  for (const auto& f : found) {
    if (f.world_size >= 0) worlds.emplace(f.world_size, f.path);
  }
  if (worlds.size() > 1) {
    throw CheckpointError("files of different world sizes: " + worlds.begin()->second + " and " +
                          worlds.rbegin()->second + " (mixed checkpoints under one prefix?)");
  }
  std::map<int64_t, std::string> by_rank;
  for (const auto& f : found) {
    const auto [it, fresh] = by_rank.emplace(f.rank, f.path);
    if (!fresh) throw CheckpointError("rank " + std::to_string(f.rank) + " has two files: " + it->second + " and " + f.path);
  }
  int64_t world = worlds.empty() ? static_cast<int64_t>(by_rank.size()) : worlds.begin()->first;
  if (world < 1) throw CheckpointError(by_rank.begin()->second + ": world size " + std::to_string(world));
  for (int64_t r = 0; r < world; ++r) {
    const auto it = by_rank.find(r);
    if (it == by_rank.end()) {
      throw CheckpointError("rank " + std::to_string(r) + " of " + std::to_string(world) + " is missing: no " +
                            rank_file_path(prefix, suffix, static_cast<int>(r), static_cast<int>(world)));
    }
    paths_.push_back(it->second);
  }
  if (by_rank.rbegin()->first >= world) {
    throw CheckpointError(by_rank.rbegin()->second + ": rank " + std::to_string(by_rank.rbegin()->first) +
                          " in a world of " + std::to_string(world));
  }
  for (const auto& path : paths_) readers_.push_back(std::make_unique<PtReader>(path));
  check_set();
  index_model();
  index_optimizer();
}

ShardedCheckpointFiles::~ShardedCheckpointFiles() = default;

void ShardedCheckpointFiles::check_set() {
  const int world = world_size();
  for (int r = 0; r < world; ++r) {
    const std::string& path = paths_[static_cast<size_t>(r)];
    const PtValue& root = reader(r).root();
    try {
      const PtValue& tag = field(root, "tdist", path);
      if (tag.at("kind").as_string() != "sharded") throw CheckpointError("not a sharded checkpoint file");
      if (tag.at("format").as_int() != kFormatVersion) {
        throw CheckpointError("format " + std::to_string(tag.at("format").as_int()) + ", this tdist reads " +
                              std::to_string(kFormatVersion));
      }
      if (tag.at("rank").as_int() != r || tag.at("world_size").as_int() != world) {
        throw CheckpointError("holds rank " + std::to_string(tag.at("rank").as_int()) + " of " +
                              std::to_string(tag.at("world_size").as_int()) + ", its name says " +
                              std::to_string(r) + " of " + std::to_string(world));
      }
      if (r == 0) save_id_ = tag.at("save_id").as_int();
      if (tag.at("save_id").as_int() != save_id_) {
        throw CheckpointError("is from another save than " + paths_[0] + " (a save that did not finish?)");
      }
      ShardMetadata md = metadata_from(field(root, "shard_metadata", path));
      for (const auto& u : md.units) {
        for (const auto& p : u.params) {
          const int64_t rows = p.shape.empty() ? 1 : p.shape[0];
          (void)numel_of(p.shape);  // negative or overflowing: refused
          if (u.sharded && p.rows_per_rank != (rows + world - 1) / world) {
            throw CheckpointError("'" + p.original_name + "' has " + std::to_string(p.rows_per_rank) +
                                  " rows per rank; FSDP's layout at world " + std::to_string(world) + " has " +
                                  std::to_string((rows + world - 1) / world));
          }
        }
      }
      if (r == 0) metadata_ = md;
      bool same = md.units.size() == metadata_.units.size();
      for (size_t u = 0; same && u < md.units.size(); ++u) {
        const auto &a = md.units[u], &b = metadata_.units[u];
        same = a.prefix == b.prefix && a.sharded == b.sharded && a.params.size() == b.params.size();
        for (size_t k = 0; same && k < a.params.size(); ++k) {
          same = a.params[k].original_name == b.params[k].original_name && a.params[k].shape == b.params[k].shape &&
                 a.params[k].rows_per_rank == b.params[k].rows_per_rank;
        }
      }
      if (!same) throw CheckpointError("its shard_metadata describes another model than " + paths_[0] + "'s");
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      throw CheckpointError(what.compare(0, path.size(), path) == 0 ? what : path + ": " + what);
    }
  }
}

LogicalTensor ShardedCheckpointFiles::logical(const std::string& name, const std::string& param,
                                              const std::string& field_name, bool sharded,
                                              const std::vector<int64_t>& full_shape,
                                              const std::vector<const PtValue*>& per_rank) const {
  LogicalTensor t;
  t.name = name;
  t.param = param;
  t.field = field_name;
  t.sharded = sharded;
  const PtTensorRef& first = per_rank[0]->as_tensor();
  for (size_t r = 0; r < per_rank.size(); ++r) {
    check_whole(per_rank[r]->as_tensor(), paths_[r], name);
  }
  t.dtype = first.dtype;
  t.shape = sharded ? full_shape : first.sizes;
  if (!sharded) {
    t.pieces.push_back(&first);
    return t;
  }
  // Rank r's piece: rows [r * rows_per_rank, ...) of the full tensor, none past its end.
  const int world = world_size();
  const int64_t rows = full_shape.empty() ? 1 : full_shape[0];
  const int64_t per = (rows + world - 1) / world;
  for (int r = 0; r < world; ++r) {
    const PtTensorRef& ref = per_rank[static_cast<size_t>(r)]->as_tensor();
    const int64_t mine = std::clamp<int64_t>(rows - r * per, 0, per);
    if (ref.sizes != rows_shape(full_shape, mine) || ref.dtype != t.dtype) {
      throw CheckpointError(paths_[static_cast<size_t>(r)] + ": '" + name + "' is " + shape_string(ref.sizes) + " " +
                            c10::toString(ref.dtype) + " where rank " + std::to_string(r) + " of " +
                            std::to_string(world) + " holds " + shape_string(rows_shape(full_shape, mine)) + " " +
                            c10::toString(t.dtype));
    }
    t.pieces.push_back(&ref);
  }
  return t;
}

void ShardedCheckpointFiles::index_model() {
  std::map<std::string, std::vector<int64_t>> sharded;  // original name -> full shape
  for (const auto& u : metadata_.units) {
    if (!u.sharded) continue;
    for (const auto& p : u.params) sharded[p.original_name] = p.shape;
  }
  const PtValue& model0 = field(reader(0).root(), "model", paths_[0]);
  for (const auto& [name, value] : model0.entries()) {
    const auto it = sharded.find(name);
    std::vector<const PtValue*> per_rank{&value};
    if (it != sharded.end()) {
      for (int r = 1; r < world_size(); ++r) {
        const PtValue* v = field(reader(r).root(), "model", paths_[static_cast<size_t>(r)]).find(name);
        if (!v) throw CheckpointError(paths_[static_cast<size_t>(r)] + ": no '" + name + "' in its model");
        per_rank.push_back(v);
      }
    }
    const bool split = it != sharded.end();
    model_.push_back(logical(name, name, "", split, split ? it->second : std::vector<int64_t>{}, per_rank));
  }
}

void ShardedCheckpointFiles::index_optimizer() {
  optimizer_tree_ = &field(reader(0).root(), "optimizer", paths_[0]);
  if (optimizer_tree_->is_none()) return;
  check_optimizer_tree(*optimizer_tree_, paths_[0] + ": optimizer");  // what the tools copy and print
  std::map<std::string, std::vector<int64_t>> sharded;
  for (const auto& t : model_) {
    if (t.sharded) sharded[t.name] = t.shape;
  }
  for (const auto& [param, fields] : optimizer_tree_->at("state").entries()) {
    const auto it = sharded.find(param);
    for (const auto& [name, value] : fields.entries()) {
      const bool split = it != sharded.end() && name != "step";
      std::vector<const PtValue*> per_rank{&value};
      for (int r = 1; split && r < world_size(); ++r) {
        const std::string& path = paths_[static_cast<size_t>(r)];
        const PtValue* fs = field(field(reader(r).root(), "optimizer", path), "state", path).find(param);
        const PtValue* v = fs ? fs->find(name) : nullptr;
        if (!v) throw CheckpointError(path + ": its optimizer state has no " + name + " for '" + param + "'");
        per_rank.push_back(v);
      }
      optimizer_.push_back(logical(param + "/" + name, param, name, split, split ? it->second : std::vector<int64_t>{},
                                   per_rank));
    }
  }
}

void ShardedCheckpointFiles::stream_full(const LogicalTensor& t, const PtReader::ByteSink& sink) const {
  // Every piece is a whole storage (check_whole), rank 0's rows first.
  for (size_t r = 0; r < t.pieces.size(); ++r) {
    if (numel_of(t.pieces[r]->sizes) > 0) reader(static_cast<int>(r)).stream_storage(*t.pieces[r], sink);
  }
}

}  // namespace tdist::checkpoint
