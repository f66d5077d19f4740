// A training run's progress as users of a trainer expect it: rank 0 shows
//
//   epoch 1/4  step 120/469  loss 0.4211  5230 samples/s  ETA 0:42
//
// On a terminal the line is redrawn in place (a few times a second, "\r");
// under tdist-run on a terminal too (tdist-run sets TDIST_TTY=1 for its
// ranks and redraws their in-place lines). Elsewhere (a log, a pipe, CI) a
// plain line is printed every `interval_s` seconds and at the last step.
// Other ranks print nothing unless `all_ranks` (then every rank prints plain
// lines, never in place); `quiet` prints no progress at all (the program's
// own end-of-epoch and final lines stay).
#pragma once

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace examples {

struct ProgressOptions {
  int rank = 0;
  bool quiet = false;      // --quiet: no progress lines
  bool all_ranks = false;  // --all-ranks: every rank shows its own
  std::string unit = "samples";  // what `items` counts: "samples", "tokens"
  double interval_s = 10;  // between plain lines when not on a terminal
};

// The flags every example takes for it: --quiet, --all-ranks.
inline void add_progress_flags(CLI::App& app, ProgressOptions& o) {
  app.add_flag("--quiet", o.quiet, "no progress lines (for logs); the end-of-epoch and final lines stay");
  app.add_flag("--all-ranks", o.all_ranks, "every rank shows its progress, not only rank 0");
}

// True when this rank's stdout ends on a terminal: its own, or that of the
// tdist-run that started it.
inline bool stdout_is_terminal() {
  if (isatty(1)) return true;
  const char* v = std::getenv("TDIST_TTY");
  return v && std::strcmp(v, "1") == 0;
}

// "1:02:03" or "2:03".
inline std::string format_duration(double seconds) {
  const long long s = static_cast<long long>(std::max(0.0, seconds) + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%lld:%02lld", s / 60, s % 60);
  return buf;
}

class Progress {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Progress(ProgressOptions o)
      : o_(std::move(o)),
        shown_(!o_.quiet && (o_.rank == 0 || o_.all_ranks)),
        // Every rank redrawing one line in place would fight over it: with
        // all_ranks, plain lines.
        live_(stdout_is_terminal() && !o_.all_ranks) {}

  // Starts the run: `total` steps in all.
  void start(int64_t total) {
    total_ = total;
    step_ = 0;
    items_ = 0;
    loss_sum_ = 0;
    loss_n_ = 0;
    t0_ = last_ = Clock::now();
  }

  // What leads the line from now on ("epoch 2/4"; empty: nothing).
  void set_label(std::string label) { label_ = std::move(label); }

  // After each step: `items` processed by this step on all ranks together,
  // the step's loss.
  void step(int64_t items, double loss) {
    ++step_;
    items_ += items;
    loss_sum_ += loss;
    ++loss_n_;
    if (!shown_) return;
    const auto now = Clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    const bool last_step = step_ == total_;
    if (live_ ? (since >= 0.2 || last_step || step_ == 1) : (since >= o_.interval_s || last_step)) {
      print(now);
      last_ = now;
    }
  }

  // Before the program prints a line of its own (an epoch's summary): a live
  // line shows its latest state and is closed with a newline.
  void finish() {
    if (shown_ && live_ && printed_) {
      if (loss_n_ > 0) print(Clock::now());
      std::printf("\n");
    }
    std::fflush(stdout);
    printed_ = false;
  }

 private:
  void print(Clock::time_point now) {
    const double secs = std::chrono::duration<double>(now - t0_).count();
    const double per_step = step_ > 0 ? secs / step_ : 0;
    const double loss = loss_n_ > 0 ? loss_sum_ / loss_n_ : 0;
    loss_sum_ = 0;
    loss_n_ = 0;
    std::string who = o_.all_ranks ? "rank " + std::to_string(o_.rank) + ": " : "";
    if (!label_.empty()) who += label_ + "  ";
    std::printf("%s%sstep %lld/%lld  loss %.4f  %.0f %s/s  ETA %s%s", live_ ? "\r" : "", who.c_str(),
                static_cast<long long>(step_), static_cast<long long>(total_), loss,
                secs > 0 ? items_ / secs : 0.0, o_.unit.c_str(), format_duration(per_step * (total_ - step_)).c_str(),
                live_ ? "\033[K" : "\n");
    std::fflush(stdout);
    printed_ = true;
  }

  ProgressOptions o_;
  bool shown_, live_;
  bool printed_ = false;
  int64_t total_ = 0, step_ = 0, items_ = 0;
  std::string label_;
  double loss_sum_ = 0;
  int64_t loss_n_ = 0;
  Clock::time_point t0_{}, last_{};
};

}  // namespace examples
