// Reading the flight recorder's dumps from files and directories, and a
// group's "ranks" string. The contract is in dump_reader.h.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>

#include "trace/dump_reader.h"
#include "util/open_file.h"
#include "util/printable.h"

namespace tdist::trace {

using detail::printable;

std::vector<int> parse_ranks(const std::string& text, int world_size) {
  const auto bad = [&](const std::string& why) -> DumpError {
    return DumpError("ranks '" + printable(text, 64) + "': " + why);
  };
  std::vector<int> out;
  std::vector<bool> seen(static_cast<size_t>(std::max(world_size, 0)));
  size_t i = 0;
  const auto spaces = [&] {
    while (i < text.size() && text[i] == ' ') ++i;
  };
  spaces();
  if (i >= text.size() || text[i] != '[') throw bad("not a list [r, ...]");
  ++i;
  spaces();
  if (i < text.size() && text[i] == ']') {
    ++i;
  } else {
    for (;;) {
      spaces();
      if (i >= text.size() || text[i] < '0' || text[i] > '9') throw bad("not a list of ranks");
      if (text[i] == '0' && i + 1 < text.size() && text[i + 1] >= '0' && text[i + 1] <= '9') {
        throw bad("a rank with a leading zero");
      }
      int64_t r = 0;
      while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
        r = r * 10 + (text[i++] - '0');
        if (r >= world_size) throw bad("a rank outside the world of " + std::to_string(world_size));
      }
      if (seen[static_cast<size_t>(r)]) throw bad("rank " + std::to_string(r) + " twice");
      seen[static_cast<size_t>(r)] = true;
      out.push_back(static_cast<int>(r));
      spaces();
      if (i < text.size() && text[i] == ',') {
        ++i;
        continue;
      }
      if (i < text.size() && text[i] == ']') {
        ++i;
        break;
      }
      throw bad("not a list of ranks");
    }
  }
  spaces();
  if (i != text.size()) throw bad("text after the list");
  return out;
}

RankDump read_dump(const std::string& path) {
  std::string error;
  struct stat st {};
  const int fd = detail::open_regular(path, O_RDONLY | O_NOFOLLOW, error, 0, &st);
  if (fd < 0) throw DumpError(error);
  std::unique_ptr<int, void (*)(int*)> closer(new int(fd), [](int* p) {
    ::close(*p);
    delete p;
  });
  const auto too_big = [&] {
    return DumpError(path + ": larger than " + std::to_string(kMaxDumpBytes >> 20) +
                     " MiB; not a flight recorder dump");
  };
  if (static_cast<uint64_t>(st.st_size) > kMaxDumpBytes) throw too_big();
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  for (;;) {
    if (got == text.size()) {
      if (text.size() > kMaxDumpBytes) throw too_big();  // it grew since the stat
      text.resize(std::min(text.size() + 65536, kMaxDumpBytes + 1));
    }
    const ssize_t n = ::read(fd, &text[got], text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw DumpError(path + ": read failed (" + std::strerror(errno) + ")");
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  if (text.empty()) throw DumpError(path + ": empty (a rank killed while writing it?)");
  return parse_dump(text, path);
}

namespace {

// R of "rank-R.json" (decimal, no sign or leading zero), or -1.
int64_t rank_of_name(const char* name) {
  const size_t n = std::strlen(name);
  if (n < 11 || std::strncmp(name, "rank-", 5) != 0 || std::strcmp(name + n - 5, ".json") != 0) return -1;
  const char* digits = name + 5;
  const size_t len = n - 10;
  if (len > 9 || (digits[0] == '0' && len > 1)) return -1;
  int64_t r = 0;
  for (size_t i = 0; i < len; ++i) {
    if (digits[i] < '0' || digits[i] > '9') return -1;
    r = r * 10 + (digits[i] - '0');
  }
  return r;
}

}  // namespace

std::vector<RankDump> read_dump_dir(const std::string& dir) {
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), ::closedir);
  if (!d) throw DumpError(dir + ": cannot list (" + std::strerror(errno) + ")");
  std::vector<std::pair<int64_t, std::string>> names;
  errno = 0;
  while (const dirent* ent = ::readdir(d.get())) {
    const int64_t r = rank_of_name(ent->d_name);
    if (r < 0) continue;
    if (names.size() >= kMaxDumpFiles) throw DumpError(dir + ": more than " + std::to_string(kMaxDumpFiles) + " dumps");
    names.emplace_back(r, ent->d_name);
  }
  if (errno != 0) throw DumpError(dir + ": cannot list (" + std::strerror(errno) + ")");
  std::sort(names.begin(), names.end());
  std::vector<RankDump> out;
  size_t used = 0;
  const std::string base = dir.empty() || dir.back() == '/' ? dir : dir + "/";
  for (const auto& [r, name] : names) {
    RankDump dump = read_dump(base + name);
    if (dump.rank != r) {
      throw DumpError(base + name + ": the dump is rank " + std::to_string(dump.rank) + "'s, not rank " +
                      std::to_string(r) + "'s");
    }
    used += dump.parsed_bytes;
    if (used > kMaxDirParsedBytes)
      throw DumpError(dir + ": more than " + std::to_string(kMaxDirParsedBytes >> 20) + " MiB of records");
    out.push_back(std::move(dump));
  }
  return out;
}

}  // namespace tdist::trace
