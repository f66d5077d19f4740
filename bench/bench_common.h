// Shared pieces of tdist-bench: options, percentiles and JSON rows.
#pragma once

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace tdist::bench {

// Parsed "--name value" / "--name=value" arguments after the mode.
class Args {
 public:
  Args(int argc, char** argv);
  std::string get(const std::string& name, const std::string& fallback) const;
  double number(const std::string& name, double fallback) const;
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  // Names given but never read: typos should not pass silently.
  void reject_unknown(const std::vector<std::string>& known) const;

 private:
  std::map<std::string, std::string> values_;
};

double percentile(std::vector<double> v, double p);

// Rows of a JSON array, each a flat object of numbers and strings.
class JsonRows {
 public:
  void begin_row() { rows_.emplace_back(); }
  void field(const std::string& k, const std::string& v);
  void field(const std::string& k, double v);
  bool write(const std::string& path) const;

 private:
  std::vector<std::vector<std::pair<std::string, std::string>>> rows_;
};

int store_bench(const Args& args);
int collectives_bench(int argc, char** argv);
int ddp_bench(int argc, char** argv);

// Forks `world` copies of this program as ranks of a local job (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; OMP_NUM_THREADS=1 unless set),
// each running `tdist-bench MODE EXTRA... ARGV...`; waits for all of them.
// Returns 0 when every rank exits 0.
int spawn_ranks(const std::string& mode, int world, const std::vector<std::string>& extra, int argc, char** argv);

}  // namespace tdist::bench
