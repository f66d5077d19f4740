#include "util/launch_env.h"

#include <cstdlib>

#include "tdist/errors.h"
#include "util/env.h"
#include "util/printable.h"

namespace tdist::detail {

namespace {

std::optional<EnvNumber> number(const std::optional<EnvValue>& v, int64_t lo) {
  if (!v) return std::nullopt;
  const auto n = parse_int(v->value);
  if (!n || *n < lo) return std::nullopt;
  return EnvNumber{*n, v->name};
}

}  // namespace

std::optional<EnvValue> first_set(EnvLookup env, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* v = env ? env(name) : std::getenv(name);
    if (v && *v) return EnvValue{name, v};
  }
  return std::nullopt;
}

std::optional<EnvNumber> local_rank_from_env(EnvLookup env) {
  return number(first_set(env, {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}), 0);
}

std::optional<EnvNumber> local_world_size_from_env(EnvLookup env) {
  if (auto v = first_set(env, {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"})) return number(v, 1);
  const auto counts = first_set(env, {"SLURM_STEP_TASKS_PER_NODE"});
  const auto node = number(first_set(env, {"SLURM_NODEID"}), 0);
  if (!counts || !node) return std::nullopt;
  const auto n = slurm_tasks_on_node(counts->value, node->value);
  if (!n || *n < 1) return std::nullopt;
  return EnvNumber{*n, "SLURM_STEP_TASKS_PER_NODE"};
}

std::optional<EnvValue> slurm_node_list(EnvLookup env) {
  return first_set(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
}

std::optional<EnvValue> slurm_job_id(EnvLookup env) { return first_set(env, {"SLURM_JOB_ID", "SLURM_JOBID"}); }

int slurm_default_port(const EnvValue& job_id) {
  const auto id = parse_int(job_id.value);
  if (!id || *id < 0) {
    throw UsageError(std::string(job_id.name) + " is '" + printable(job_id.value, 40) +
                     "', not a Slurm job id (a number)");
  }
  return static_cast<int>(20000 + *id % 10000);
}

std::optional<int64_t> slurm_tasks_on_node(std::string_view counts, int64_t node) {
  if (node < 0) return std::nullopt;
  size_t pos = 0;
  // A decimal number of 1 to 9 digits at counts[pos] (Slurm's are 16-bit).
  auto read = [&]() -> std::optional<int64_t> {
    const size_t start = pos;
    int64_t v = 0;
    while (pos < counts.size() && counts[pos] >= '0' && counts[pos] <= '9') {
      if (pos - start == 9) return std::nullopt;
      v = v * 10 + (counts[pos++] - '0');
    }
    if (pos == start) return std::nullopt;
    return v;
  };
  std::optional<int64_t> found;
  int64_t first_node = 0;  // of the item being read
  for (;;) {
    const auto tasks = read();
    if (!tasks) return std::nullopt;
    int64_t repeat = 1;
    if (counts.substr(pos, 2) == "(x") {
      pos += 2;
      const auto r = read();
      if (!r || *r < 1 || pos >= counts.size() || counts[pos] != ')') return std::nullopt;
      ++pos;
      repeat = *r;
    }
    if (!found && node - first_node < repeat) found = *tasks;
    if (!found) first_node += repeat;  // stops growing once found: below node + 10^9, no overflow
    if (pos == counts.size()) return found;  // the whole text read: a malformed one is no answer
    if (counts[pos] != ',') return std::nullopt;
    ++pos;
  }
}

}  // namespace tdist::detail
