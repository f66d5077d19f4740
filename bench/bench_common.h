// Shared pieces of tdist-bench: each mode's options (registered on a CLI11
// subcommand), percentiles, JSON rows, and spawning the ranks of a job.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

namespace tdist::bench {

struct StoreBenchOptions {
  std::string store = "tcp";
  std::string clients = "1,4,16";
  double seconds = 1.0;
  size_t value_bytes = 64;
  std::string json;
  void add_to(CLI::App& mode);
};

struct CollectivesBenchOptions {
  std::string backend = "shm";
  int world_size = 2;
  std::string op = "all_reduce";
  std::string min_bytes = "4";
  std::string max_bytes = "256M";
  double step_factor = 4;
  std::string dtype = "float32";
  double seconds = 0.25;
  bool symmetric = false;
  // Each timed op queued and its Work waited for (async_op=true), instead
  // of one synchronous call (async_op=false, as MPI's blocking calls).
  bool async = false;
  // An untimed barrier before every timed op, so that no rank runs ahead
  // (a small broadcast's root otherwise returns at once and gets ahead of
  // its receivers; bench/mpi_collectives_reference.c has the same flag).
  bool barrier_each = false;
  // "cpp": the C++ API; "c": the C ABI (include/tdist/c/tdist.h), as a
  // language binding calls it, with what it adds per op over C++.
  std::string api = "cpp";
  std::string json;
  // Set by the parent for its ranks: the machine's memcpy bandwidth.
  double memcpy_one = 0, memcpy_all = 0;
  void add_to(CLI::App& mode);
};

struct DdpBenchOptions {
  std::string backend = "shm";
  int world_size = 2;
  int steps = 10;
  int rounds = 10;
  std::string variants;  // empty: all
  double bucket_cap_mb = 25;
  std::optional<double> first_bucket_cap_mb;  // default: min(1, bucket_cap_mb)
  std::string device = "cpu";  // or "cuda": every rank on cuda:0 (DDP's device_id)
  std::string json;
  void add_to(CLI::App& mode);
};

struct FsdpBenchOptions {
  int world_size = 2;
  std::string backend = "shm";  // or "gloo"
  std::string model = "mlp";  // or "vit"
  // 0: the model's default (mlp: 8 blocks, W 1024, H 4096, batch 8;
  // vit: 8 blocks, W 256, H 1024, 8 heads, batch 64).
  int blocks = 0;
  int64_t width = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t batch = 0;
  int steps = 6;
  int rounds = 3;
  bool forward_prefetch = false;  // FSDP's forward_prefetch (the FSDP variants)
  std::string variants;  // empty: all
  std::string json;
  std::string run_variant;  // set for the ranks of one variant's job
  std::string result;       // where that job's rank 0 writes its numbers
  void add_to(CLI::App& mode);
};

struct CheckpointBenchOptions {
  int world_size = 2;
  double size_mib = 1024;  // parameters + Adam's moments, fp32
  int layers = 8;
  std::string dir = "/tmp";
  int repeats = 3;
  std::string writer = "idle";  // the Checkpointer's idle_writes: idle or nice
  std::string overlap = "on";   // the Checkpointer's overlap_copy: on or off
  std::string format = "tdist";  // tdist (per-rank .pt files) or dcp (PyTorch's DCP folder)
  std::string python;            // dcp: the Python whose dcp.load is timed beside (empty: none)
  std::string json;
  std::string run_dir, result;  // set by the parent for its ranks
  void add_to(CLI::App& mode);
};

double percentile(std::vector<double> v, double p);

// Rows of a JSON array, each a flat object of numbers and strings in the
// order given. Whole numbers are written exactly, measurements to 6
// significant digits.
class JsonRows {
 public:
  void begin_row() { rows_.push_back(nlohmann::ordered_json::object()); }
  void field(const std::string& k, const std::string& v) { rows_.back()[k] = v; }
  void field(const std::string& k, const char* v) { rows_.back()[k] = v; }
  void field(const std::string& k, double v);
  // The end of a mode: flushes stdout, writes the rows to `path` (none if
  // empty) and returns the mode's exit status (1, said on stderr, if the
  // file cannot be written).
  int finish(const std::string& path) const;

 private:
  nlohmann::ordered_json rows_ = nlohmann::ordered_json::array();
};

// `args` are the mode's own arguments, which the ranks it spawns get again.
int store_bench(const StoreBenchOptions& o);
int collectives_bench(const CollectivesBenchOptions& o, const std::vector<std::string>& args);
int ddp_bench(const DdpBenchOptions& o, const std::vector<std::string>& args);
int fsdp_bench(const FsdpBenchOptions& o, const std::vector<std::string>& args);
int checkpoint_bench(const CheckpointBenchOptions& o, const std::vector<std::string>& args);

// The source tree this program was built from (its Python references are in
// bench/). Compiled into tdist_bench.cpp alone: a path on every bench file's
// compile line would make each miss ccache in every fresh clone.
const char* source_dir();

// Forks `world` copies of this program as ranks of a local job (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; OMP_NUM_THREADS=1 unless set),
// each running `tdist-bench MODE ARGS... EXTRA...`; waits for all of them.
// Returns 0 when every rank exits 0.
int spawn_ranks(const std::string& mode, int world, const std::vector<std::string>& args,
                const std::vector<std::string>& extra);

}  // namespace tdist::bench
