// Command lines of tdist's programs (tdist-run, tdist-store-server,
// tdist-bench), on CLI11: torchrun's two spellings of an option, and one
// way to fail (exit 2 with the program's name; --help exits 0).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace tdist::cli {

// "nproc-per-node" -> "--nproc-per-node,--nproc_per_node".
inline std::string both_spellings(const std::string& dashed) {
  std::string under = dashed;
  for (auto& ch : under) if (ch == '-') ch = '_';
  return under == dashed ? "--" + dashed : "--" + dashed + ",--" + under;
}

[[noreturn]] inline void usage_error(const std::string& program, const std::string& why) {
  std::fprintf(stderr, "%s: %s\nRun with --help for the options.\n", program.c_str(), why.c_str());
  std::exit(2);
}

// Parses or exits: --help prints the help and exits 0, anything wrong
// exits 2 after one line saying what.
inline void parse_or_exit(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::CallForAllHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::ParseError& e) {
    usage_error(app.get_name(), e.what());
  }
}

}  // namespace tdist::cli
