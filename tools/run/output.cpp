#include "run/output.h"

#include <cstdio>

namespace tdist_run {

std::string_view on_screen(const std::string& s, size_t from, size_t to, size_t* start) {
  while (to > from && s[to - 1] == '\r') --to;
  size_t b = from;
  for (size_t i = to; i > from; --i) {
    if (s[i - 1] == '\r') {
      b = i;
      break;
    }
  }
  if (start) *start = b;
  return std::string_view(s).substr(b, to - b);
}

void RankOutput::reset() {
  partial_.clear();
  open_line_ = -1;
}

void RankOutput::line(int rank, std::string_view text) {
  if (open_line_ >= 0) std::printf(open_line_ == rank ? "\r\033[K" : "\n");
  open_line_ = -1;
  std::printf("[rank %d]: %.*s\n", rank, static_cast<int>(text.size()), text.data());
}

void RankOutput::emit(int rank, const char* data, size_t n, bool final) {
  std::string& partial = partial_[rank];
  partial.append(data, n);
  size_t start = 0;
  for (;;) {
    const size_t nl = partial.find('\n', start);
    if (nl == std::string::npos) break;
    line(rank, on_screen(partial, start, nl));
    start = nl + 1;
  }
  partial.erase(0, start);
  if (!final && partial.size() > kMaxLine) {
    line(rank, on_screen(partial, 0, partial.size()));
    partial.clear();
  }
  if (final) {
    if (!partial.empty()) line(rank, on_screen(partial, 0, partial.size()));
    partial_.erase(rank);
  } else if (tty_ && partial.find('\r') != std::string::npos) {
    size_t b = 0;
    const std::string_view text = on_screen(partial, 0, partial.size(), &b);
    if (open_line_ >= 0 && open_line_ != rank) std::printf("\n");
    std::printf("\r[rank %d]: %.*s\033[K", rank, static_cast<int>(text.size()), text.data());
    open_line_ = rank;
    if (b > 0) partial.erase(0, b - 1);  // from the '\r' before the text: the line is still being redrawn
  }
  std::fflush(stdout);
}

}  // namespace tdist_run
