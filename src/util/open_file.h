// Opening a file that a user, a peer or a directory listing named, without
// blocking on what is not a file. Every open of such a path in tdist goes
// through open_regular (one place for the rule):
//
//   - O_NONBLOCK, O_NOCTTY and O_CLOEXEC are added: a FIFO named where a
//     checkpoint, a token or a store was expected cannot hang the open
//     (a FIFO opened for reading returns at once; for writing, with no
//     reader, it fails with ENXIO), and a terminal cannot become the
//     process's controlling one;
//   - the descriptor is fstat'ed, and anything but a regular file (FIFO,
//     directory, character or block device, socket) is refused, the path
//     and its type named;
//   - O_NONBLOCK is cleared again, so reads and writes of the file block
//     (and are complete) as usual.
//
// The caller adds O_NOFOLLOW where a symbolic link must not be followed
// (secrets, files created in shared directories). Header-only: the store,
// the checkpoint files and the tools each link it without a library.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace tdist::detail {

// "a FIFO (named pipe)", "a directory", ...: what st_mode says a path is.
inline std::string file_type_name(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// Opens `path` as described above. Returns the descriptor, or -1 with
// `error` saying why, the path first: "PATH: is a FIFO (named pipe), not a
// regular file", "PATH: cannot open (No such file or directory)"; errno is
// then the open's error (0 for a file of the wrong type). `st`, if given,
// receives the file's stat on success.
inline int open_regular(const std::string& path, int flags, std::string& error, mode_t mode = 0600,
                        struct stat* st = nullptr) {
  const int fd = ::open(path.c_str(), flags | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, mode);
  if (fd < 0) {
    const int e = errno;
    if (e == EISDIR) {  // opened for writing
      error = path + ": is a directory, not a regular file";
      errno = e;
      return -1;
    }
    error = path + ": cannot open (" + (e == ELOOP && (flags & O_NOFOLLOW) ? "a symbolic link, not followed here"
                                        : e == ENXIO ? "a FIFO or device with no reader" : std::strerror(e)) + ")";
    errno = e;
    return -1;
  }
  struct stat own {};
  struct stat& s = st ? *st : own;
  if (::fstat(fd, &s) != 0) {
    const int e = errno;
    ::close(fd);
    error = path + ": cannot stat (" + std::strerror(e) + ")";
    errno = e;
    return -1;
  }
  if (!S_ISREG(s.st_mode)) {
    ::close(fd);
    error = path + ": is " + file_type_name(s.st_mode) + ", not a regular file";
    errno = 0;
    return -1;
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    const int e = errno;
    ::close(fd);
    error = path + ": cannot clear O_NONBLOCK (" + std::strerror(e) + ")";
    errno = e;
    return -1;
  }
  return fd;
}

// open_regular, throwing Error(message) on failure.
template <class Error>
int open_regular_or_throw(const std::string& path, int flags, mode_t mode = 0600, struct stat* st = nullptr) {
  std::string error;
  const int fd = open_regular(path, flags, error, mode, st);
  if (fd < 0) throw Error(error);
  return fd;
}

// Reads at most `limit` bytes of a regular file (the first ones) into
// `out`; false with `error` set when it cannot be opened or read. For small
// files: /proc entries, tokens, results a child process wrote.
inline bool read_regular_file(const std::string& path, size_t limit, std::string& out, std::string& error,
                              int extra_flags = 0) {
  const int fd = open_regular(path, O_RDONLY | extra_flags, error);
  if (fd < 0) return false;
  out.clear();
  char buf[4096];
  while (out.size() < limit) {
    const ssize_t n = ::read(fd, buf, sizeof buf < limit - out.size() ? sizeof buf : limit - out.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      error = path + ": read failed (" + std::strerror(errno) + ")";
      ::close(fd);
      return false;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return true;
}

}  // namespace tdist::detail
