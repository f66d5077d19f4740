// A Checkpointer directory's names: the contract is in latest_marker.h.
#include "checkpoint/latest_marker.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>

#include "tdist/errors.h"
#include "util/open_file.h"

namespace tdist::checkpoint {

std::string step_folder_name(int64_t step, uint64_t save_id) {
  char name[48];
  std::snprintf(name, sizeof name, "step-%08lld-%016llx", static_cast<long long>(step),
                static_cast<unsigned long long>(save_id));
  return name;
}

std::optional<StepFolder> parse_step_folder(const std::string& name) {
  const size_t dash = name.find('-', 5);
  if (name.compare(0, 5, "step-") != 0 || dash == std::string::npos || dash < 13 || dash > 24 ||
      name.size() != dash + 17) {
    return std::nullopt;
  }
  int64_t v = 0;
  for (size_t i = 5; i < dash; ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  for (size_t i = dash + 1; i < name.size(); ++i) {
    const char c = name[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return std::nullopt;
  }
  return StepFolder{v, name};
}

std::vector<StepFolder> read_latest_marker(const std::string& dir, const std::string& who) {
  const std::string path = dir + "/" + kLatestMarker;
  std::string text, error;
  // One byte past the bound is enough to know the marker is too long.
  if (!detail::read_regular_file(path, kLatestMarkerBytes + 1, text, error, O_NOFOLLOW)) {
    if (errno == ENOENT) return {};
    throw CheckpointError(who + ": the latest marker " + error);
  }
  const auto bad = [&](const std::string& why) {
    return CheckpointError(who + ": the latest marker " + path + " " + why + "; remove it to start afresh");
  };
  if (text.size() > kLatestMarkerBytes) throw bad("is over " + std::to_string(kLatestMarkerBytes) + " bytes");
  std::vector<StepFolder> out;
  for (size_t at = 0; at < text.size();) {
    const size_t nl = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, nl - at);
    at = nl + 1;
    if (line.empty()) continue;
    const auto f = parse_step_folder(line);
    if (!f) throw bad("holds a line that names no step folder (\"step-NNNNNNNN-<16 hex digits>\")");
    out.push_back(*f);
  }
  if (out.empty()) throw bad("names no step folder");
  return out;
}

}  // namespace tdist::checkpoint
