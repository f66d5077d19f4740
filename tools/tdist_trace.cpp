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
//
//   tdist-trace merge DIR|FILE... -o OUT
//   tdist-trace summary DIR|FILE... [--json]
//
// merge and summary read the timelines ranks write with TDIST_TRACE=PATH
// or start_timeline(PATH), PATH.rank-<R>.json (Chrome trace events;
// tools/trace/timeline_tools.h): merge puts them in
// one file (every rank a process: load it in Perfetto), summary prints per
// step the compute, the exposed communication and the overlap. A
// directory stands for its *.rank-<R>.json files. Exit 0, or 2 on a bad
// command line or unreadable input.
// Links no LibTorch.
#include <cstdio>
#include <string>
#include <vector>

#include "trace/analyze.h"
#include "trace/dump_reader.h"
#include "trace/timeline_tools.h"
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

int run_merge(const std::vector<std::string>& inputs, const std::string& out) {
  try {
    const auto files = tdist::trace::trace_files(inputs);
    const size_t n = tdist::trace::merge_traces(files, out);
    std::printf("%zu events from %zu traces in %s\n", n, files.size(), out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-trace: error: %s\n", tdist::detail::printable(e.what(), 1024).c_str());
    return 2;
  }
}

int run_summary(const std::vector<std::string>& inputs, bool json) {
  try {
    const auto s = tdist::trace::summarize(tdist::trace::trace_files(inputs));
    const std::string out = json ? tdist::trace::summary_json(s) : s.report;
    std::fwrite(out.data(), 1, out.size(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-trace: error: %s\n", tdist::detail::printable(e.what(), 1024).c_str());
    return 2;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tdist-trace: read what a job's ranks recorded: the flight recorder's dumps (analyze) and the\n"
               "timelines (merge, summary)",
               "tdist-trace"};
  app.require_subcommand(1);
  app.footer("The dumps: DIR/rank-<R>.json, one per rank, written on a timeout, a dead peer, a mismatch,\n"
             "SIGUSR1 (tdist-run sends it on a stall) or tdist::trace::dump_flight_recorder(); DIR is\n"
             "$TDIST_DUMP_DIR, else ./tdist-dumps/<job> (what tdist-run sets).\n"
             "The timelines: PATH.rank-<R>.json, one per rank, written at exit (and on\n"
             "tdist::trace::flush_timeline()) when the job ran with TDIST_TRACE=PATH or called\n"
             "tdist::trace::start_timeline(PATH); summary also reads merge's output.\n");
  std::string dir;
  bool json = false;
  CLI::App* analyze = app.add_subcommand(
      "analyze", "line the flight recorder's dumps (DIR/rank-<R>.json) up per group: who a hang waits for, "
                 "mismatches, failures");
  analyze->add_option("DIR", dir, "the dumps' directory ($TDIST_DUMP_DIR, by default ./tdist-dumps/<job>)")->required();
  analyze->add_flag("--json", json, "every finding, as JSON");
  std::vector<std::string> inputs;
  std::string out;
  CLI::App* merge = app.add_subcommand(
      "merge", "every rank's timeline (PATH.rank-<R>.json, from TDIST_TRACE=PATH) in one Chrome trace file");
  merge->add_option("INPUT", inputs, "timeline files, or directories of *.rank-<R>.json")->required();
  merge->add_option("-o,--output", out, "the merged trace")->required();
  bool summary_json = false;
  CLI::App* summary = app.add_subcommand(
      "summary", "from the timelines (PATH.rank-<R>.json, from TDIST_TRACE=PATH), per step and rank: compute, "
                 "exposed communication, overlap");
  summary->add_option("INPUT", inputs, "timeline files (per rank or merged), or directories of *.rank-<R>.json")
      ->required();
  summary->add_flag("--json", summary_json, "every rank's steps, as JSON");
  tdist::cli::parse_or_exit(app, argc, argv);
  if (analyze->parsed()) return run_analyze(dir, json);
  if (merge->parsed()) return run_merge(inputs, out);
  if (summary->parsed()) return run_summary(inputs, summary_json);
  return 2;
}
