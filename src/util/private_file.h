// Whether an open file (or shared-memory object) is this user's alone:
// owned by the effective uid, with no permission bits for group or others.
// Job secrets and the memory ranks share are checked with it before use.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace tdist::detail {

// Empty when fd is private to this user; else why not ("belongs to uid
// 1001", "mode 644 lets others in"), or the fstat error.
inline std::string why_not_private(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return "cannot be inspected (fstat failed)";
  if (st.st_uid != geteuid()) return "belongs to uid " + std::to_string(st.st_uid) + ", not to this user";
  if (st.st_mode & 077) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%03o", static_cast<unsigned>(st.st_mode & 0777));
    return std::string("has mode ") + mode + ", which lets others in";
  }
  return {};
}

}  // namespace tdist::detail
