// tdist-run's screen: every line a rank prints, led by "[rank N]: ". A line
// a rank redraws in place ("\r", a progress line) is shown in place too
// when the launcher writes to a terminal (the ranks are then told so by
// TDIST_TTY=1: see run/supervisor.h); elsewhere only what a terminal would
// finally show of each line is kept. A rank's line that never ends is shown
// in pieces of kMaxLine bytes: the launcher holds no more than that per
// rank, whatever the rank prints.
//
// Owns: each rank's output not yet ended by a newline, and which rank's
// in-place line is on the screen. Needs: stdout, which it writes and
// flushes. Threading: the launcher's loop only.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <string_view>

namespace tdist_run {

// What a terminal would show of s[from, to): the text after the last '\r'
// that has text after it (trailing '\r's, as in "\r\n" or "50%\r", end a
// text rather than start one). Its start is returned in `start`.
std::string_view on_screen(const std::string& s, size_t from, size_t to, size_t* start = nullptr);

class RankOutput {
 public:
  static constexpr size_t kMaxLine = size_t(1) << 20;

  // `tty`: stdout is a terminal (in-place lines are drawn in place).
  explicit RankOutput(bool tty) : tty_(tty) {}

  bool tty() const { return tty_; }
  // A new start of the job: no rank's line is on the screen.
  void reset();
  // `n` bytes that `rank` wrote.
  void write(int rank, const char* data, size_t n) { emit(rank, data, n, false); }
  // `rank`'s output ended (its pipe closed): shows what is left of it.
  void close(int rank) { emit(rank, "", 0, true); }

 private:
  void emit(int rank, const char* data, size_t n, bool final);
  // One finished line of `rank`, after closing the in-place line on the screen.
  void line(int rank, std::string_view text);

  bool tty_;
  std::map<int, std::string> partial_;  // by rank: output not yet ended by a newline
  int open_line_ = -1;                  // the rank whose in-place line is on the screen; -1: none
};

}  // namespace tdist_run
