// tdist-trace: reading the flight recorder's dumps (docs/observability.md).
//
//   tdist-trace analyze DIR [--json]
//
// analyze reads every rank-<R>.json in DIR (tools/trace/dump_reader.h: a
// bounded parse; a damaged or hostile file is an error naming it) and
// lines the ranks up per group (tools/trace/analyze.h): who a hang waits
// for, where ranks called different collectives, what failed. It prints a
// few lines, the most important first, or with --json every finding.
// Exit: 0 when every group agrees and nothing is pending, 1 when it found
// a problem, 2 on a bad command line, unreadable input or no dumps.
// (merge and summary, over the Chrome trace files, are planned beside it.)
// Links no LibTorch.
#include <cstdio>
#include <string>
#include <vector>

#include "trace/analyze.h"
#include "trace/dump_reader.h"
#include "util/cli.h"
#include "util/printable.h"

namespace {

int run_analyze(const std::string& dir, bool json) {
  std::vector<tdist::trace::RankDump> dumps;
  try {
    dumps = tdist::trace::read_dump_dir(dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-trace: error: %s\n", tdist::detail::printable(e.what(), 1024).c_str());
    return 2;
  }
  if (dumps.empty()) {
    std::fprintf(stderr, "tdist-trace: error: %s: no rank-<R>.json dumps\n",
                 tdist::detail::printable(dir, 1024).c_str());
    return 2;
  }
  const tdist::trace::Analysis a = tdist::trace::analyze(dumps);
  const std::string out = json ? tdist::trace::analysis_json(a) : a.report;
  std::fwrite(out.data(), 1, out.size(), stdout);
  return a.exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tdist-trace: read the flight recorder's dumps", "tdist-trace"};
  app.require_subcommand(1);
  std::string dir;
  bool json = false;
  CLI::App* analyze = app.add_subcommand(
      "analyze", "line the ranks' dumps (DIR/rank-<R>.json) up per group: who a hang waits for, mismatches, failures");
  analyze->add_option("DIR", dir, "the dumps' directory ($TDIST_DUMP_DIR)")->required();
  analyze->add_flag("--json", json, "every finding, as JSON");
  tdist::cli::parse_or_exit(app, argc, argv);
  if (analyze->parsed()) return run_analyze(dir, json);
  return 2;
}
