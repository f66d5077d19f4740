// Fashion-MNIST for the examples: Debian's dataset-fashion-mnist (gzipped
// IDX files) as tensors, and the test accuracy over every rank's share of
// the test set.
#pragma once

#include <torch/torch.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <stdexcept>
#include <string>

#include "tdist/process_group.h"

namespace examples {

// The whole of a gzipped file, at most max_bytes of it unpacked (a gzip
// bomb stops there). Only a regular file is read: the open does not wait on
// a FIFO or a device.
inline std::string gunzip(const std::string& path, size_t max_bytes) {
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) throw std::runtime_error("cannot open " + path + " (is dataset-fashion-mnist installed?)");
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || fcntl(fd, F_SETFL, 0) != 0) {
    close(fd);
    throw std::runtime_error(path + ": not a regular file");
  }
  gzFile f = gzdopen(fd, "rb");
  if (!f) {
    close(fd);
    throw std::runtime_error("cannot read " + path);
  }
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) {
    if (out.size() + static_cast<size_t>(n) > max_bytes) {
      gzclose(f);
      throw std::runtime_error(path + ": unpacks to more than " + std::to_string(max_bytes) + " bytes");
    }
    out.append(buf, n);
  }
  const bool bad = n < 0;
  gzclose(f);
  if (bad) throw std::runtime_error(path + ": corrupt gzip data");
  return out;
}

// Fashion-MNIST's largest file (60000 images) unpacks to 47 MB.
inline constexpr size_t kMaxIdxBytes = size_t(256) << 20;

inline uint32_t be32(const std::string& s, size_t at) {
  return uint32_t(uint8_t(s[at])) << 24 | uint32_t(uint8_t(s[at + 1])) << 16 | uint32_t(uint8_t(s[at + 2])) << 8 |
         uint32_t(uint8_t(s[at + 3]));
}

// IDX files: images as [N, 1, 28, 28] floats normalised, labels as [N] int64.
inline torch::Tensor read_images(const std::string& path) {
  const std::string s = gunzip(path, kMaxIdxBytes);
  if (s.size() < 16 || be32(s, 0) != 0x803) throw std::runtime_error(path + ": not an IDX image file");
  const int64_t n = be32(s, 4), rows = be32(s, 8), cols = be32(s, 12);
  // The file decides these: compare without overflowing (rows * cols fits in
  // 32 bits here; n * it is checked by division).
  if (rows == 0 || cols == 0 || rows > 65536 || cols > 65536) throw std::runtime_error(path + ": bad image size");
  const int64_t image = rows * cols;
  if (n > static_cast<int64_t>(s.size()) / image || s.size() != static_cast<size_t>(16 + n * image)) throw std::runtime_error(path + ": truncated");
  auto t = torch::from_blob(const_cast<char*>(s.data() + 16), {n, 1, rows, cols}, torch::kUInt8).to(torch::kFloat);
  return (t / 255.0 - 0.2860) / 0.3530;  // Fashion-MNIST's mean and std
}

inline torch::Tensor read_labels(const std::string& path) {
  const std::string s = gunzip(path, kMaxIdxBytes);
  if (s.size() < 8 || be32(s, 0) != 0x801) throw std::runtime_error(path + ": not an IDX label file");
  const int64_t n = be32(s, 4);
  if (s.size() != static_cast<size_t>(8 + n)) throw std::runtime_error(path + ": truncated");
  return torch::from_blob(const_cast<char*>(s.data() + 8), {n}, torch::kUInt8).to(torch::kLong);
}

struct FashionMnist {
  torch::Tensor train_x, train_y, test_x, test_y;
};
inline FashionMnist load_fashion_mnist(const std::string& dir) {
  return {read_images(dir + "/train-images-idx3-ubyte.gz"), read_labels(dir + "/train-labels-idx1-ubyte.gz"),
          read_images(dir + "/t10k-images-idx3-ubyte.gz"), read_labels(dir + "/t10k-labels-idx1-ubyte.gz")};
}

// The fraction of the test set `predict` gets right, each rank taking every
// world-th image (collective).
template <typename Predict>
double test_accuracy(const FashionMnist& d, tdist::ProcessGroup& pg, Predict predict, int64_t batch = 1000) {
  const torch::Tensor mine = torch::arange(pg.rank(), d.test_x.size(0), pg.size(), torch::kLong);
  int64_t right = 0;
  for (int64_t at = 0; at < mine.numel(); at += batch) {
    const torch::Tensor idx = mine.slice(0, at, std::min(mine.numel(), at + batch));
    right += predict(d.test_x.index_select(0, idx)).argmax(1).eq(d.test_y.index_select(0, idx)).sum().template item<int64_t>();
  }
  torch::Tensor counts = torch::tensor({right, mine.numel()});
  pg.all_reduce(counts)->wait();
  return static_cast<double>(counts[0].item<int64_t>()) / counts[1].item<int64_t>();
}

}  // namespace examples
