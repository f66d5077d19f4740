// Writing a whole small file (a dump, a timeline) where readers may look
// at any moment: written to PATH.<pid>.tmp (created afresh, never through
// a link), then renamed over PATH. No fsync: these files explain a run,
// they do not have to survive a power cut. The trace files' one place for
// it.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "util/open_file.h"

namespace tdist::detail {

// True when `text` is at `path`; otherwise false with `error` saying why
// (and no temporary file left).
inline bool write_aside(const std::string& path, const std::string& text, std::string& error) {
  const std::string tmp = path + "." + std::to_string(::getpid()) + ".tmp";
  ::unlink(tmp.c_str());
  const int fd = open_regular(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, error, 0644);
  if (fd < 0) return false;
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error = std::strerror(n < 0 ? errno : EIO);
      ::close(fd);
      ::unlink(tmp.c_str());
      return false;
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    error = std::strerror(errno);
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace tdist::detail
