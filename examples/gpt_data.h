// Byte-level text for examples/gpt.cpp: a file's bytes are its tokens.
//
// The split: the last n/10 bytes (integer division) validate, the bytes
// before them train. Training batches are windows of block_size + 1 bytes
// at offsets drawn by SplitMix64, the same on every rank: step s draws
// world * batch_size offsets, rank r takes entries [r * batch_size, (r+1) *
// batch_size), so a run at any world size sees the same global batches as
// one process with world * batch_size (bench/gpt_reference.py draws them
// the same way). Validation: consecutive non-overlapping windows of
// block_size + 1 bytes from the start of the validation bytes (an
// incomplete last one dropped).
#pragma once

#include <torch/torch.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace examples {

// Where Debian's fortunes packages put their text (scripts/install-deps.sh
// installs fortunes and fortunes-min).
inline constexpr const char* kFortuneDir = "/usr/share/games/fortunes";
// More than any text file this example is meant for; a larger one is
// refused rather than read into memory.
inline constexpr int64_t kMaxTextBytes = int64_t{4} << 30;

// The whole of a regular file, at most max_bytes. Opened non-blocking (a
// FIFO named as the data cannot hang the run) and refused unless fstat
// says it is a regular file.
inline std::string read_text_file(const std::string& path, int64_t max_bytes = kMaxTextBytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(path + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    throw std::runtime_error(path + ": not a regular file");
  }
  if (st.st_size > max_bytes) {
    close(fd);
    throw std::runtime_error(path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                             std::to_string(max_bytes) + " this example reads");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = read(fd, out.data() + got, out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  close(fd);
  out.resize(got);  // a file that shrank while being read
  return out;
}

// The English text of Debian's fortunes packages, concatenated in name
// order: every regular file of kFortuneDir without an extension (the .dat
// indexes and .u8 links are skipped). About 2.5 MB.
inline std::string fortunes_corpus() {
  DIR* d = opendir(kFortuneDir);
  if (!d) {
    throw std::runtime_error(std::string("no text to train on: ") + kFortuneDir +
                             " is missing (install Debian's fortunes and fortunes-min, or pass --data FILE)");
  }
  std::vector<std::string> names;
  while (const dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n.empty() || n[0] == '.' || n.find('.') != std::string::npos) continue;
    names.push_back(n);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  std::string out;
  for (const auto& n : names) {
    const std::string path = std::string(kFortuneDir) + "/" + n;
    struct stat st;
    if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;  // links, directories
    out += read_text_file(path, kMaxTextBytes - static_cast<int64_t>(out.size()));
  }
  if (out.empty()) throw std::runtime_error(std::string(kFortuneDir) + " holds no text");
  return out;
}

// SplitMix64: the offsets' generator (a few lines in any language).
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

class ByteText {
 public:
  explicit ByteText(std::string bytes) : bytes_(std::move(bytes)) {
    const int64_t n = static_cast<int64_t>(bytes_.size());
    val_begin_ = n - n / 10;
  }
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  int64_t train_bytes() const { return val_begin_; }
  int64_t val_bytes() const { return size() - val_begin_; }

  // Step `step`'s inputs and targets for `rank`: [batch, block] each (int64).
  std::pair<torch::Tensor, torch::Tensor> train_batch(uint64_t seed, int64_t step, int rank, int world,
                                                      int64_t batch, int64_t block) const {
    const int64_t span = train_bytes() - block;  // offsets [0, span): a window of block + 1 bytes fits
    if (span < 1) {
      throw std::runtime_error("the training text (" + std::to_string(train_bytes()) + " bytes) is shorter than a window of " +
                               std::to_string(block + 1) + " bytes");
    }
    // One generator per step: step s's draws do not depend on the steps before.
    uint64_t state = seed * 0x100000001B3ULL + static_cast<uint64_t>(step);
    torch::Tensor x = torch::empty({batch, block}, torch::kLong), y = torch::empty({batch, block}, torch::kLong);
    int64_t* px = x.data_ptr<int64_t>();
    int64_t* py = y.data_ptr<int64_t>();
    for (int64_t i = 0; i < static_cast<int64_t>(world) * batch; ++i) {
      const int64_t off = static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(span));
      const int64_t row = i - static_cast<int64_t>(rank) * batch;
      if (row < 0 || row >= batch) continue;
      for (int64_t j = 0; j < block; ++j) {
        px[row * block + j] = static_cast<uint8_t>(bytes_[off + j]);
        py[row * block + j] = static_cast<uint8_t>(bytes_[off + j + 1]);
      }
    }
    return {x, y};
  }

  int64_t val_windows(int64_t block) const { return val_bytes() / (block + 1); }
  // Validation windows [first, first + count): inputs and targets.
  std::pair<torch::Tensor, torch::Tensor> val_batch(int64_t first, int64_t count, int64_t block) const {
    torch::Tensor x = torch::empty({count, block}, torch::kLong), y = torch::empty({count, block}, torch::kLong);
    int64_t* px = x.data_ptr<int64_t>();
    int64_t* py = y.data_ptr<int64_t>();
    for (int64_t w = 0; w < count; ++w) {
      const int64_t off = val_begin_ + (first + w) * (block + 1);
      for (int64_t j = 0; j < block; ++j) {
        px[w * block + j] = static_cast<uint8_t>(bytes_[off + j]);
        py[w * block + j] = static_cast<uint8_t>(bytes_[off + j + 1]);
      }
    }
    return {x, y};
  }

 private:
  std::string bytes_;
  int64_t val_begin_ = 0;
};

}  // namespace examples
