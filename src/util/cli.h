// Command lines of tdist's programs (tdist-run, tdist-store-server,
// tdist-bench), on CLI11: torchrun's two spellings of an option, and one
// way to fail (exit 2 with the program's name; --help exits 0).
#pragma once

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

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

// A finite number from lo to hi, both included. (CLI11's Range and
// PositiveNumber let NaN through and print their bounds in full, a
// 300-digit number for PositiveNumber.)
inline CLI::Validator in_range(double lo, double hi) {
  const auto text = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.15g", v);
    return std::string(buf);
  };
  const std::string desc = "in [" + text(lo) + ", " + text(hi) + "]";
  return CLI::Validator(
      [lo, hi, desc](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v) || !std::isfinite(v) || v < lo || v > hi) {
          return "'" + s + "' is not a number " + desc;
        }
        return {};
      },
      "NUMBER " + desc);
}

// The subcommand word of a program with subcommands: one it has, or exit 2
// naming the word given (or its absence) and listing them.
inline void check_subcommand(CLI::App& app, int argc, char** argv) {
  const std::function<bool(CLI::App*)> all = [](CLI::App*) { return true; };
  const std::vector<CLI::App*> subs = app.get_subcommands(all);
  std::string names;
  for (const CLI::App* sub : subs) names += (names.empty() ? "" : ", ") + sub->get_name();
  if (names.empty()) return;
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word.empty() || word[0] == '-') continue;  // --help, or an option of the program itself
    for (CLI::App* sub : subs) {
      if (sub->check_name(word)) return;
    }
    std::string shown;
    for (const unsigned char c : word) shown += c < 0x20 || c == 0x7f ? '?' : static_cast<char>(c);
    usage_error(app.get_name(), "unknown subcommand '" + shown + "'; the subcommands are " + names);
  }
  bool help = false;
  for (int i = 1; i < argc; ++i) help = help || std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h";
  if (!help) usage_error(app.get_name(), "a subcommand is required: one of " + names);
}

// Parses or exits: --help prints the help and exits 0, anything wrong
// exits 2 after one line saying what.
inline void parse_or_exit(CLI::App& app, int argc, char** argv) {
  check_subcommand(app, argc, argv);
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
