// StagingBackend: the copies around each call of the inner backend. The
// contract is in staging_backend.h.
#include "cuda/staging_backend.h"

#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/cuda_check.h"

namespace tdist::cuda {

namespace {

using comm::DataType;
using comm::Deadline;
using comm::Piece;
using comm::ReduceOp;

class StagingBackend final : public comm::Backend {
 public:
  explicit StagingBackend(comm::Backend& inner) : Backend(inner.rank(), inner.size()), inner_(inner) {}

  std::string name() const override { return inner_.name(); }
  bool supports_cuda() const override { return true; }

  void all_reduce(void* buf, size_t count, DataType t, ReduceOp op, Deadline d) override {
    const size_t bytes = count * comm::dtype_size(t);
    void* h = to_host(a_, buf, bytes);
    inner_.all_reduce(h, count, t, op, d);
    to_device(buf, h, bytes);
  }

  void all_reduce_coalesced(const std::vector<Piece>& pieces, DataType t, ReduceOp op, Deadline d) override {
    size_t total = 0;
    void* h = pack(pieces, t, &total);
    inner_.all_reduce_coalesced({Piece{h, total}}, t, op, d);
    unpack(pieces, t, h);
  }

  void all_reduce_coalesced_as(const std::vector<Piece>& pieces, DataType t, DataType wire, ReduceOp op,
                               Deadline d) override {
    size_t total = 0;
    void* h = pack(pieces, t, &total);
    inner_.all_reduce_coalesced_as({Piece{h, total}}, t, wire, op, d);
    unpack(pieces, t, h);
  }

  void broadcast(void* buf, size_t bytes, int root, Deadline d) override {
    void* h = rank() == root ? to_host(a_, buf, bytes) : host_only(a_, bytes);
    inner_.broadcast(h, bytes, root, d);
    if (rank() != root) to_device(buf, h, bytes);
  }

  void reduce(void* buf, size_t count, DataType t, ReduceOp op, int root, Deadline d) override {
    const size_t bytes = count * comm::dtype_size(t);
    void* h = to_host(a_, buf, bytes);
    inner_.reduce(h, count, t, op, root, d);
    if (rank() == root) to_device(buf, h, bytes);
  }

  void all_gather(const void* in, void* out, size_t bytes, Deadline d) override {
    void* hin = to_host(a_, in, bytes);
    void* hout = host_only(b_, bytes * static_cast<size_t>(size()));
    inner_.all_gather(hin, hout, bytes, d);
    to_device(out, hout, bytes * static_cast<size_t>(size()));
  }

  void reduce_scatter(const void* in, void* out, size_t count, DataType t, ReduceOp op, Deadline d) override {
    const size_t bytes = count * comm::dtype_size(t);
    void* hin = to_host(a_, in, bytes * static_cast<size_t>(size()));
    void* hout = host_only(b_, bytes);
    inner_.reduce_scatter(hin, hout, count, t, op, d);
    to_device(out, hout, bytes);
  }

  void all_gather_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                            Deadline d) override {
    stage_coalesced(in, out, t, [&](const std::vector<Piece>& hin, const std::vector<Piece>& hout) {
      inner_.all_gather_coalesced(hin, hout, t, d);
    });
  }

  void reduce_scatter_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                                ReduceOp op, Deadline d) override {
    stage_coalesced(in, out, t, [&](const std::vector<Piece>& hin, const std::vector<Piece>& hout) {
      inner_.reduce_scatter_coalesced(hin, hout, t, op, d);
    });
  }

  void gather(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    const bool is_root = rank() == root;
    void* hin = to_host(a_, in, bytes);
    void* hout = is_root ? host_only(b_, bytes * static_cast<size_t>(size())) : nullptr;
    inner_.gather(hin, hout, bytes, root, d);
    if (is_root) to_device(out, hout, bytes * static_cast<size_t>(size()));
  }

  void scatter(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    const bool is_root = rank() == root;
    void* hin = is_root ? to_host(a_, in, bytes * static_cast<size_t>(size())) : nullptr;
    void* hout = host_only(b_, bytes);
    inner_.scatter(hin, hout, bytes, root, d);
    to_device(out, hout, bytes);
  }

  void all_to_all(const void* in, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  void* out, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  Deadline d) override {
    const size_t in_total = extent(send_bytes, send_offsets);
    const size_t out_total = extent(recv_bytes, recv_offsets);
    void* hin = to_host(a_, in, in_total);
    void* hout = host_only(b_, out_total);
    inner_.all_to_all(hin, send_bytes, send_offsets, hout, recv_bytes, recv_offsets, d);
    to_device(out, hout, out_total);
  }

  void barrier(Deadline d) override { inner_.barrier(d); }

  void send(const void* buf, size_t bytes, int dst, int tag, Deadline d) override {
    inner_.send(to_host(a_, buf, bytes), bytes, dst, tag, d);
  }

  void recv(void* buf, size_t bytes, int src, int tag, Deadline d) override {
    void* h = host_only(a_, bytes);
    inner_.recv(h, bytes, src, tag, d);
    to_device(buf, h, bytes);
  }

  void abort(const std::string& reason) override { inner_.abort(reason); }

 private:
  static size_t extent(const std::vector<size_t>& bytes, const std::vector<size_t>& offsets) {
    size_t end = 0;
    for (size_t i = 0; i < bytes.size() && i < offsets.size(); ++i) end = std::max(end, offsets[i] + bytes[i]);
    return end;
  }

  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

  // Host memory the inner call may write, once the device has finished
  // reading the staging buffers of the previous call.
  void* host_only(PinnedBuffer& buf, size_t bytes) {
    void* h = buf.get(bytes);
    check(cudaStreamSynchronize(stream()), "waiting for the staging stream");
    return h;
  }

  // The device bytes at dev, copied into buf and waited for.
  void* to_host(PinnedBuffer& buf, const void* dev, size_t bytes) {
    void* h = buf.get(bytes);
    if (bytes > 0) check(cudaMemcpyAsync(h, dev, bytes, cudaMemcpyDeviceToHost, stream()), "staging to the host");
    check(cudaStreamSynchronize(stream()), "waiting for the copy to the host");
    return h;
  }

  // Queued on the current stream; the scope's end event covers it.
  void to_device(void* dev, const void* h, size_t bytes) {
    if (bytes == 0) return;
    check(cudaMemcpyAsync(dev, h, bytes, cudaMemcpyHostToDevice, stream()), "copying back to the device");
  }

  void* pack(const std::vector<Piece>& pieces, DataType t, size_t* total) {
    const size_t es = comm::dtype_size(t);
    *total = 0;
    for (const auto& p : pieces) *total += p.count;
    auto* h = static_cast<uint8_t*>(a_.get(*total * es));
    size_t off = 0;
    for (const auto& p : pieces) {
      if (p.count > 0) {
        check(cudaMemcpyAsync(h + off, p.data, p.count * es, cudaMemcpyDeviceToHost, stream()), "staging to the host");
      }
      off += p.count * es;
    }
    check(cudaStreamSynchronize(stream()), "waiting for the copy to the host");
    return h;
  }

  void unpack(const std::vector<Piece>& pieces, DataType t, const void* h) {
    const size_t es = comm::dtype_size(t);
    size_t off = 0;
    for (const auto& p : pieces) {
      to_device(p.data, static_cast<const uint8_t*>(h) + off, p.count * es);
      off += p.count * es;
    }
  }

  // A coalesced op on host copies: the inputs packed in a_, the outputs
  // laid end to end in b_, each copied back to its device piece.
  template <typename Call>
  void stage_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t, Call&& call) {
    const size_t es = comm::dtype_size(t);
    size_t in_total = 0, out_total = 0;
    auto* hin = static_cast<uint8_t*>(pack(in, t, &in_total));
    for (const auto& p : out) out_total += p.count;
    auto* hout = static_cast<uint8_t*>(host_only(b_, out_total * es));
    std::vector<Piece> host_in, host_out;
    for (const auto& p : in) {
      host_in.push_back({hin, p.count});
      hin += p.count * es;
    }
    for (const auto& p : out) {
      host_out.push_back({hout, p.count});
      hout += p.count * es;
    }
    call(host_in, host_out);
    for (size_t k = 0; k < out.size(); ++k) to_device(out[k].data, host_out[k].data, out[k].count * es);
  }

  comm::Backend& inner_;
  PinnedBuffer a_;  // inputs (and in-place buffers)
  PinnedBuffer b_;  // outputs
};

}  // namespace

std::unique_ptr<comm::Backend> make_staging_backend(comm::Backend& inner) {
  return std::make_unique<StagingBackend>(inner);
}

}  // namespace tdist::cuda
