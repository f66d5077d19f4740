// ProcessGroup's tensor ops: each checks its tensors on the caller's
// thread, then queues a body that runs it through the group's comm::Backend
// (group_impl.h). How groups are made is in init.cpp.
#include "tdist/process_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>

#include "comm/reduce.h"
#include "process_group/group_impl.h"
#include "process_group/tensor_util.h"
#include "util/bytes.h"

namespace tdist {

namespace {

comm::ReduceOp to_comm(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return comm::ReduceOp::kSum;
    case ReduceOp::AVG: return comm::ReduceOp::kAvg;
    case ReduceOp::PRODUCT: return comm::ReduceOp::kProduct;
    case ReduceOp::MIN: return comm::ReduceOp::kMin;
    case ReduceOp::MAX: return comm::ReduceOp::kMax;
    case ReduceOp::BAND: return comm::ReduceOp::kBand;
    case ReduceOp::BOR: return comm::ReduceOp::kBor;
    case ReduceOp::BXOR: return comm::ReduceOp::kBxor;
  }
  throw UsageError("unknown ReduceOp " + std::to_string(static_cast<int>(op)));
}

std::string shape_of(const at::Tensor& t) {
  std::string s = std::string(c10::toString(t.scalar_type())) + "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "]";
}

const char* reduce_name(ReduceOp op) { return comm::reduce_op_name(to_comm(op)); }

// Bytes, for collective_counts.
int64_t nb(const at::Tensor& t) { return static_cast<int64_t>(t.nbytes()); }
// The flight recorder's dtype of an op on t (Impl::Traffic::dtype).
int fr_dtype(const at::Tensor& t) { return static_cast<int>(detail::to_comm_dtype(t.scalar_type(), "", "")); }
int64_t total_bytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += nb(t);
  return n;
}

}  // namespace

int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size; }
const std::vector<int>& ProcessGroup::ranks() const { return impl_->ranks; }
const std::string& ProcessGroup::backend_name() const { return impl_->backend_name; }
std::string ProcessGroup::backend_name(c10::DeviceType device) const {
  if (device == c10::DeviceType::CUDA && !impl_->cuda_backend_name.empty()) return impl_->cuda_backend_name;
  return impl_->backend_name;
}
const std::string& ProcessGroup::group_name() const { return impl_->group_name; }
Milliseconds ProcessGroup::timeout() const { return impl_->timeout; }

// ---- collectives --------------------------------------------------------------

namespace {

// The wire type of an all-reduce: the tensors' own, or a narrower float
// for float32 tensors (AllreduceOptions::wire_dtype).
comm::DataType wire_type(const AllreduceOptions& o, comm::DataType dt, const char* op) {
  if (!o.wire_dtype) return dt;
  const auto wire = detail::to_comm_dtype(*o.wire_dtype, op, "wire_dtype");
  if (wire == dt) return dt;
  if (dt != comm::DataType::kFloat32 || !comm::can_convert(wire, dt)) {
    throw UsageError(std::string(op) + ": wire_dtype " + c10::toString(*o.wire_dtype) +
                     " needs float32 tensors and a float16 or bfloat16 wire type (tensors are " +
                     comm::dtype_name(dt) + ")");
  }
  return wire;
}

std::string wire_note(comm::DataType dt, comm::DataType wire) {
  return wire == dt ? "" : std::string(" as ") + comm::dtype_name(wire);
}

}  // namespace

std::shared_ptr<Work> ProcessGroup::all_reduce(const at::Tensor& tensor, const AllreduceOptions& o) {
  const auto dt = impl_->check(tensor, "all_reduce");
  const auto op = to_comm(o.op);
  const auto wire = wire_type(o, dt, "all_reduce");
  comm::check_reduction(wire, op);
  const auto dev = impl_->op_device("all_reduce", tensor);
  comm::Backend* b = impl_->backend_for(dev, "all_reduce");
  const int64_t wire_bytes = tensor.numel() * static_cast<int64_t>(comm::dtype_size(wire));
  const Impl::Traffic traffic{wire_bytes, wire_bytes, static_cast<int>(wire)};
  return impl_->enqueue(detail::GroupOp::kAllReduce, traffic, o.timeout, o.async_op,
                        [=, t = tensor](comm::Deadline d) mutable -> detail::OpResult {
    if (wire == dt) {
      b->all_reduce(t.data_ptr(), static_cast<size_t>(t.numel()), dt, op, d);
    } else {
      b->all_reduce_coalesced_as({comm::Piece{t.data_ptr(), static_cast<size_t>(t.numel())}}, dt, wire, op, d);
    }
    return {std::move(t)};
  }, [&] { return std::string("all_reduce " + shape_of(tensor) + wire_note(dt, wire) + " " + reduce_name(o.op)); }, dev);
}

std::shared_ptr<Work> ProcessGroup::all_reduce_coalesced(const std::vector<at::Tensor>& tensors,
                                                         const AllreduceOptions& o) {
  if (tensors.empty()) throw UsageError("all_reduce_coalesced: no tensors given");
  const auto dt = impl_->check(tensors[0], "all_reduce_coalesced", "tensors[0]");
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string what = "tensors[" + std::to_string(i) + "]";
    impl_->check(tensors[i], "all_reduce_coalesced", what.c_str());
    detail::check_same_dtype(tensors[0], tensors[i], "all_reduce_coalesced");
    total += tensors[i].numel();
  }
  const auto op = to_comm(o.op);
  const auto wire = wire_type(o, dt, "all_reduce_coalesced");
  comm::check_reduction(wire, op);
  const auto dev = impl_->op_device("all_reduce_coalesced", tensors);
  comm::Backend* b = impl_->backend_for(dev, "all_reduce_coalesced");
  const int64_t wire_bytes = total * static_cast<int64_t>(comm::dtype_size(wire));
  const Impl::Traffic traffic{wire_bytes, wire_bytes, static_cast<int>(wire)};
  return impl_->enqueue(detail::GroupOp::kAllReduceCoalesced, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    std::vector<comm::Piece> pieces;
    pieces.reserve(tensors.size());
    for (const auto& t : tensors) pieces.push_back({t.data_ptr(), static_cast<size_t>(t.numel())});
    b->all_reduce_coalesced_as(pieces, dt, wire, op, d);  // wire == dt: a plain all_reduce_coalesced
    return tensors;
  }, [&] { return std::string("all_reduce_coalesced " + std::string(c10::toString(tensors[0].scalar_type())) + " x " +
         std::to_string(total) + wire_note(dt, wire) + " " + reduce_name(o.op)); }, dev);
}

// ---- accounting ------------------------------------------------------------------

std::map<std::string, CollectiveCount> ProcessGroup::collective_counts() const { return impl_->counts.read(); }

void ProcessGroup::reset_collective_counts() { impl_->counts.reset(); }

// ---- symmetric memory ------------------------------------------------------------

bool ProcessGroup::has_symmetric_memory() const { return impl_->backend->has_symmetric_memory(); }

bool ProcessGroup::is_symmetric(const at::Tensor& t) const {
  return t.defined() && t.device().is_cpu() && t.is_contiguous() && t.numel() > 0 &&
         impl_->backend->is_symmetric(t.data_ptr(), t.nbytes());
}

namespace {
std::atomic<int64_t>& symmetric_bytes_live() {
  static std::atomic<int64_t>* n = new std::atomic<int64_t>(0);  // blocks may die during static destruction
  return *n;
}
}  // namespace

int64_t symmetric_memory_bytes() { return symmetric_bytes_live().load(); }

at::Tensor ProcessGroup::empty_symmetric(at::IntArrayRef sizes, at::ScalarType dtype, const CollectiveOptions& o) {
  for (int64_t s : sizes) {
    if (s < 0) throw UsageError("empty_symmetric: negative size " + std::to_string(s));
  }
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  if (!has_symmetric_memory()) return at::zeros(sizes, options);
  const std::vector<int64_t> shape(sizes.begin(), sizes.end());
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
  comm::Backend* b = impl_->backend.get();
  const std::string group = impl_->group_name;
  auto work = impl_->enqueue(detail::GroupOp::kEmptySymmetric, {}, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    std::string why_not;
    std::shared_ptr<void> block = b->allocate_symmetric(bytes, d, &why_not);
    if (!block) {
      std::fprintf(stderr, "tdist: empty_symmetric in group '%s': no symmetric memory (%s); using ordinary memory\n",
                   group.c_str(), why_not.c_str());
      return {at::zeros(shape, options)};
    }
    void* data = block.get();
    symmetric_bytes_live().fetch_add(static_cast<int64_t>(bytes));
    return {at::from_blob(data, shape, [block = std::move(block), bytes](void*) mutable {
      block.reset();
      symmetric_bytes_live().fetch_sub(static_cast<int64_t>(bytes));
    }, options)};
  }, [&] { return std::string("empty_symmetric " + std::to_string(bytes) + " bytes"); });
  work->wait();
  return work->result().at(0);
}

std::shared_ptr<Work> ProcessGroup::broadcast(const at::Tensor& tensor, const BroadcastOptions& o) {
  impl_->check(tensor, "broadcast");
  impl_->check_rank(o.root, "broadcast", "root");
  const auto dev = impl_->op_device("broadcast", tensor);
  comm::Backend* b = impl_->backend_for(dev, "broadcast");
  const Impl::Traffic traffic{nb(tensor), nb(tensor), fr_dtype(tensor)};
  return impl_->enqueue(detail::GroupOp::kBroadcast, traffic, o.timeout, o.async_op,
                        [b, root = o.root, t = tensor](comm::Deadline d) mutable -> detail::OpResult {
    b->broadcast(t.data_ptr(), t.nbytes(), root, d);
    return {std::move(t)};
  }, [&] { return std::string("broadcast " + shape_of(tensor) + " root " + std::to_string(o.root)); }, dev);
}

std::shared_ptr<Work> ProcessGroup::reduce(const at::Tensor& tensor, const ReduceOptions& o) {
  const auto dt = impl_->check(tensor, "reduce");
  impl_->check_rank(o.root, "reduce", "root");
  const auto op = to_comm(o.op);
  comm::check_reduction(dt, op);
  const auto dev = impl_->op_device("reduce", tensor);
  comm::Backend* b = impl_->backend_for(dev, "reduce");
  const Impl::Traffic traffic{nb(tensor), rank() == o.root ? nb(tensor) : 0, fr_dtype(tensor)};
  return impl_->enqueue(detail::GroupOp::kReduce, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    b->reduce(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), dt, op, o.root, d);
    return {tensor};
  }, [&] { return std::string("reduce " + shape_of(tensor) + " " + reduce_name(o.op) + " root " + std::to_string(o.root)); }, dev);
}

std::shared_ptr<Work> ProcessGroup::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input,
                                                           const CollectiveOptions& o) {
  impl_->check(input, "all_gather_into_tensor", "input");
  impl_->check(output, "all_gather_into_tensor", "output");
  detail::check_same_dtype(output, input, "all_gather_into_tensor");
  detail::check_numel(output, input.numel() * size(), "all_gather_into_tensor", "output");
  const auto dev = impl_->op_device("all_gather_into_tensor", input, output);
  comm::Backend* b = impl_->backend_for(dev, "all_gather_into_tensor");
  const Impl::Traffic traffic{nb(input), nb(output), fr_dtype(input)};
  return impl_->enqueue(detail::GroupOp::kAllGatherIntoTensor, traffic, o.timeout, o.async_op,
                        [b, input, out = output](comm::Deadline d) mutable -> detail::OpResult {
    b->all_gather(input.data_ptr(), out.data_ptr(), input.nbytes(), d);
    return {std::move(out)};
  }, [&] { return std::string("all_gather " + shape_of(input)); }, dev);
}

std::shared_ptr<Work> ProcessGroup::all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                               const CollectiveOptions& o) {
  impl_->check(input, "all_gather", "input");
  detail::check_list(outputs, size(), input, "all_gather", "outputs", impl_->allows_cuda());
  const auto dev = impl_->op_device("all_gather", outputs, input);
  comm::Backend* b = impl_->backend_for(dev, "all_gather");
  const Impl::Traffic traffic{nb(input), nb(input) * size(), fr_dtype(input)};
  return impl_->enqueue(detail::GroupOp::kAllGather, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    at::Tensor flat = at::empty({input.numel() * static_cast<int64_t>(outputs.size())}, input.options());
    b->all_gather(input.data_ptr(), flat.data_ptr(), input.nbytes(), d);
    detail::unflatten_into(flat, outputs);
    return outputs;
  }, [&] { return std::string("all_gather " + shape_of(input)); }, dev);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                                                          const ReduceScatterOptions& o) {
  const auto dt = impl_->check(output, "reduce_scatter_tensor", "output");
  impl_->check(input, "reduce_scatter_tensor", "input");
  detail::check_same_dtype(output, input, "reduce_scatter_tensor");
  detail::check_numel(input, output.numel() * size(), "reduce_scatter_tensor", "input");
  const auto op = to_comm(o.op);
  comm::check_reduction(dt, op);
  const auto dev = impl_->op_device("reduce_scatter_tensor", input, output);
  comm::Backend* b = impl_->backend_for(dev, "reduce_scatter_tensor");
  const Impl::Traffic traffic{nb(input), nb(output), fr_dtype(input)};
  return impl_->enqueue(detail::GroupOp::kReduceScatterTensor, traffic, o.timeout, o.async_op,
                        [b, input, out = output, dt, op](comm::Deadline d) mutable -> detail::OpResult {
    b->reduce_scatter(input.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()), dt, op, d);
    return {std::move(out)};
  }, [&] { return std::string("reduce_scatter " + shape_of(output) + " " + reduce_name(o.op)); }, dev);
}

namespace {

// The checks of a coalesced op's lists: as many outputs as inputs (at
// least one), one dtype, each output `ratio` times its input's elements
// (all_gather) or each input `ratio` times its output's (reduce_scatter).
// Returns the dtype and the elements of the smaller sides, summed.
struct CoalescedShape {
  comm::DataType dtype;
  int64_t elements = 0;
};

CoalescedShape check_coalesced(const ProcessGroup::Impl& impl, const std::vector<at::Tensor>& outputs,
                               const std::vector<at::Tensor>& inputs, const char* op, bool output_larger) {
  if (inputs.empty()) throw UsageError(std::string(op) + ": no tensors given");
  if (outputs.size() != inputs.size()) {
    throw UsageError(std::string(op) + ": " + std::to_string(outputs.size()) + " outputs for " +
                     std::to_string(inputs.size()) + " inputs; give one output per input");
  }
  CoalescedShape shape{impl.check(inputs[0], op, "inputs[0]"), 0};
  for (size_t k = 0; k < inputs.size(); ++k) {
    const std::string in_name = "inputs[" + std::to_string(k) + "]";
    const std::string out_name = "outputs[" + std::to_string(k) + "]";
    impl.check(inputs[k], op, in_name.c_str());
    impl.check(outputs[k], op, out_name.c_str());
    detail::check_same_dtype(inputs[0], inputs[k], op);
    detail::check_same_dtype(inputs[0], outputs[k], op);
    if (output_larger) {
      detail::check_numel(outputs[k], inputs[k].numel() * impl.size, op, out_name.c_str());
      shape.elements += inputs[k].numel();
    } else {
      detail::check_numel(inputs[k], outputs[k].numel() * impl.size, op, in_name.c_str());
      shape.elements += outputs[k].numel();
    }
  }
  return shape;
}

// UsageError when an input's bytes overlap an output's: pieces go one by
// one or packed, so one piece's output may be written before another's
// input is read. own_slot_rank >= 0 (an all-gather) allows the one overlap
// an all-gather has in place: input k exactly that rank's slot of output k.
void check_no_overlap(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, const char* op,
                      int own_slot_rank = -1) {
  const auto span = [](const at::Tensor& t) {
    const auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(b, b + t.nbytes());
  };
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k].numel() == 0) continue;
    const auto in = span(inputs[k]);
    for (size_t j = 0; j < outputs.size(); ++j) {
      if (outputs[j].numel() == 0) continue;
      const auto out = span(outputs[j]);
      if (in.second <= out.first || out.second <= in.first) continue;
      if (own_slot_rank < 0) {
        throw UsageError(std::string(op) + ": outputs[" + std::to_string(j) + "] overlaps inputs[" +
                         std::to_string(k) + "]; give the outputs memory of their own");
      }
      const uintptr_t own_slot = out.first + static_cast<uintptr_t>(own_slot_rank) * inputs[k].nbytes();
      if (j == k && in.first == own_slot) continue;  // in place
      throw UsageError(std::string(op) + ": inputs[" + std::to_string(k) + "] overlaps outputs[" + std::to_string(j) +
                       "] other than as its own rank's slot of outputs[" + std::to_string(k) + "]");
    }
  }
}

// "[n0,n1,...]": a coalesced op's piece sizes, for its signature.
std::string counts_of(const std::vector<at::Tensor>& ts) {
  std::string s = "[";
  for (size_t k = 0; k < ts.size(); ++k) s += (k ? "," : "") + std::to_string(ts[k].numel());
  return s + "]";
}

std::vector<comm::Piece> pieces_of(const std::vector<at::Tensor>& ts) {
  std::vector<comm::Piece> pieces;
  pieces.reserve(ts.size());
  for (const auto& t : ts) pieces.push_back({t.data_ptr(), static_cast<size_t>(t.numel())});
  return pieces;
}

}  // namespace

std::shared_ptr<Work> ProcessGroup::all_gather_into_tensor_coalesced(const std::vector<at::Tensor>& outputs,
                                                                     const std::vector<at::Tensor>& inputs,
                                                                     const CollectiveOptions& o) {
  const char* op = "all_gather_into_tensor_coalesced";
  const CoalescedShape shape = check_coalesced(*impl_, outputs, inputs, op, /*output_larger=*/true);
  check_no_overlap(outputs, inputs, op, /*own_slot_rank=*/rank());
  const auto dev = impl_->op_device(op, inputs, outputs);
  comm::Backend* b = impl_->backend_for(dev, op);
  const int64_t bytes = shape.elements * static_cast<int64_t>(comm::dtype_size(shape.dtype));
  const Impl::Traffic traffic{bytes, bytes * size(), static_cast<int>(shape.dtype)};
  const comm::DataType dt = shape.dtype;
  return impl_->enqueue(detail::GroupOp::kAllGatherIntoTensorCoalesced, traffic, o.timeout, o.async_op,
                        [=](comm::Deadline d) -> detail::OpResult {
    b->all_gather_coalesced(pieces_of(inputs), pieces_of(outputs), dt, d);
    return outputs;
  }, [&] {
    return std::string("all_gather_coalesced ") + c10::toString(inputs[0].scalar_type()) + " x " +
           counts_of(inputs);
  }, dev);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_tensor_coalesced(const std::vector<at::Tensor>& outputs,
                                                                    const std::vector<at::Tensor>& inputs,
                                                                    const ReduceScatterOptions& o) {
  const char* op = "reduce_scatter_tensor_coalesced";
  const CoalescedShape shape = check_coalesced(*impl_, outputs, inputs, op, /*output_larger=*/false);
  check_no_overlap(outputs, inputs, op);
  const auto rop = to_comm(o.op);
  comm::check_reduction(shape.dtype, rop);
  const auto dev = impl_->op_device(op, inputs, outputs);
  comm::Backend* b = impl_->backend_for(dev, op);
  const int64_t bytes = shape.elements * static_cast<int64_t>(comm::dtype_size(shape.dtype));
  const Impl::Traffic traffic{bytes * size(), bytes, static_cast<int>(shape.dtype)};
  const comm::DataType dt = shape.dtype;
  return impl_->enqueue(detail::GroupOp::kReduceScatterTensorCoalesced, traffic, o.timeout, o.async_op,
                        [=](comm::Deadline d) -> detail::OpResult {
    b->reduce_scatter_coalesced(pieces_of(inputs), pieces_of(outputs), dt, rop, d);
    return outputs;
  }, [&] {
    return std::string("reduce_scatter_coalesced ") + c10::toString(outputs[0].scalar_type()) + " x " +
           counts_of(outputs) + " " + reduce_name(o.op);
  }, dev);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                                   const ReduceScatterOptions& o) {
  const auto dt = impl_->check(output, "reduce_scatter", "output");
  detail::check_list(inputs, size(), output, "reduce_scatter", "inputs", impl_->allows_cuda());
  const auto op = to_comm(o.op);
  comm::check_reduction(dt, op);
  const auto dev = impl_->op_device("reduce_scatter", inputs, output);
  comm::Backend* b = impl_->backend_for(dev, "reduce_scatter");
  const Impl::Traffic traffic{nb(output) * size(), nb(output), fr_dtype(output)};
  return impl_->enqueue(detail::GroupOp::kReduceScatter, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    at::Tensor flat = detail::flatten(inputs);
    b->reduce_scatter(flat.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()), dt, op, d);
    return {output};
  }, [&] { return std::string("reduce_scatter " + shape_of(output) + " " + reduce_name(o.op)); }, dev);
}

std::shared_ptr<Work> ProcessGroup::gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                           const RootOptions& o) {
  impl_->check(input, "gather", "input");
  impl_->check_rank(o.root, "gather", "root");
  const bool is_root = rank() == o.root;
  if (is_root) {
    detail::check_list(outputs, size(), input, "gather", "outputs", impl_->allows_cuda());
  } else if (!outputs.empty()) {
    throw UsageError("gather: outputs must be empty on non-root rank " + std::to_string(rank()));
  }
  const auto dev = impl_->op_device("gather", outputs, input);
  comm::Backend* b = impl_->backend_for(dev, "gather");
  const int world = size();
  const Impl::Traffic traffic{nb(input), is_root ? nb(input) * world : 0, fr_dtype(input)};
  return impl_->enqueue(detail::GroupOp::kGather, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    at::Tensor flat = is_root ? at::empty({input.numel() * world}, input.options()) : at::Tensor();
    b->gather(input.data_ptr(), is_root ? flat.data_ptr() : nullptr, input.nbytes(), o.root, d);
    if (is_root) detail::unflatten_into(flat, outputs);
    return outputs;
  }, [&] { return std::string("gather " + shape_of(input) + " root " + std::to_string(o.root)); }, dev);
}

std::shared_ptr<Work> ProcessGroup::scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                            const RootOptions& o) {
  impl_->check(output, "scatter", "output");
  impl_->check_rank(o.root, "scatter", "root");
  const bool is_root = rank() == o.root;
  if (is_root) {
    detail::check_list(inputs, size(), output, "scatter", "inputs", impl_->allows_cuda());
  } else if (!inputs.empty()) {
    throw UsageError("scatter: inputs must be empty on non-root rank " + std::to_string(rank()));
  }
  const auto dev = impl_->op_device("scatter", inputs, output);
  comm::Backend* b = impl_->backend_for(dev, "scatter");
  const Impl::Traffic traffic{is_root ? nb(output) * size() : 0, nb(output), fr_dtype(output)};
  return impl_->enqueue(detail::GroupOp::kScatter, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    at::Tensor flat = is_root ? detail::flatten(inputs) : at::Tensor();
    b->scatter(is_root ? flat.data_ptr() : nullptr, output.data_ptr(), output.nbytes(), o.root, d);
    return {output};
  }, [&] { return std::string("scatter " + shape_of(output) + " root " + std::to_string(o.root)); }, dev);
}

std::shared_ptr<Work> ProcessGroup::all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                                      const std::vector<int64_t>& output_split_sizes,
                                                      const std::vector<int64_t>& input_split_sizes,
                                                      const CollectiveOptions& o) {
  impl_->check(input, "all_to_all_single", "input");
  impl_->check(output, "all_to_all_single", "output");
  detail::check_same_dtype(output, input, "all_to_all_single");
  auto send = detail::split_bytes(input, input_split_sizes, size(), "all_to_all_single", "input");
  auto recv = detail::split_bytes(output, output_split_sizes, size(), "all_to_all_single", "output");
  const auto dev = impl_->op_device("all_to_all_single", input, output);
  comm::Backend* b = impl_->backend_for(dev, "all_to_all_single");
  const Impl::Traffic traffic{nb(input), nb(output), fr_dtype(input)};
  return impl_->enqueue(detail::GroupOp::kAllToAllSingle, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    b->all_to_all(input.data_ptr(), send.bytes, send.offsets, output.data_ptr(), recv.bytes, recv.offsets, d);
    return {output};
  }, [&] { return std::string("all_to_all ") + c10::toString(input.scalar_type()); }, dev);
}

std::shared_ptr<Work> ProcessGroup::all_to_all(const std::vector<at::Tensor>& outputs,
                                               const std::vector<at::Tensor>& inputs, const CollectiveOptions& o) {
  if (static_cast<int>(inputs.size()) != size() || static_cast<int>(outputs.size()) != size()) {
    throw UsageError("all_to_all: needs " + std::to_string(size()) + " inputs and outputs, got " +
                     std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  }
  for (const auto& t : inputs) impl_->check(t, "all_to_all", "inputs[i]");
  for (const auto& t : outputs) {
    impl_->check(t, "all_to_all", "outputs[i]");
    detail::check_same_dtype(t, inputs[0], "all_to_all");
  }
  const auto dev = impl_->op_device("all_to_all", outputs, inputs);
  comm::Backend* b = impl_->backend_for(dev, "all_to_all");
  const Impl::Traffic traffic{total_bytes(inputs), total_bytes(outputs), inputs.empty() ? (outputs.empty() ? -1 : fr_dtype(outputs[0])) : fr_dtype(inputs[0])};
  return impl_->enqueue(detail::GroupOp::kAllToAll, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    at::Tensor in = detail::flatten(inputs);
    std::vector<size_t> send_bytes, send_off, recv_bytes, recv_off;
    size_t off = 0;
    for (const auto& t : inputs) {
      send_bytes.push_back(t.nbytes());
      send_off.push_back(off);
      off += t.nbytes();
    }
    off = 0;
    for (const auto& t : outputs) {
      recv_bytes.push_back(t.nbytes());
      recv_off.push_back(off);
      off += t.nbytes();
    }
    at::Tensor out = at::empty({static_cast<int64_t>(off)}, outputs[0].options().dtype(at::kByte));
    b->all_to_all(in.data_ptr(), send_bytes, send_off, out.data_ptr(), recv_bytes, recv_off, d);
    detail::unflatten_into(out, outputs);
    return outputs;
  }, [&] { return std::string("all_to_all ") + c10::toString(inputs[0].scalar_type()); }, dev);
}

std::shared_ptr<Work> ProcessGroup::barrier(const CollectiveOptions& o) {
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue(detail::GroupOp::kBarrier, {}, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    b->barrier(d);
    return {};
  }, [&] { return std::string("barrier"); });
}

std::shared_ptr<Work> ProcessGroup::send(const at::Tensor& tensor, int dst, int tag, const CollectiveOptions& o) {
  impl_->check(tensor, "send");
  impl_->check_rank(dst, "send", "destination");
  if (dst == rank()) throw UsageError("send: rank " + std::to_string(dst) + " cannot send to itself");
  const auto dev = impl_->op_device("send", tensor);
  comm::Backend* b = impl_->backend_for(dev, "send");
  const Impl::Traffic traffic{nb(tensor), 0, fr_dtype(tensor), dst};
  return impl_->enqueue(detail::GroupOp::kSend, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    b->send(tensor.data_ptr(), tensor.nbytes(), dst, tag, d);
    return {tensor};
  }, [] { return std::string(); }, dev);
}

std::shared_ptr<Work> ProcessGroup::recv(const at::Tensor& tensor, int src, int tag, const CollectiveOptions& o) {
  impl_->check(tensor, "recv");
  impl_->check_rank(src, "recv", "source");
  if (src == rank()) throw UsageError("recv: rank " + std::to_string(src) + " cannot receive from itself");
  const auto dev = impl_->op_device("recv", tensor);
  comm::Backend* b = impl_->backend_for(dev, "recv");
  const Impl::Traffic traffic{0, nb(tensor), fr_dtype(tensor), src};
  return impl_->enqueue(detail::GroupOp::kRecv, traffic, o.timeout, o.async_op, [=](comm::Deadline d) -> detail::OpResult {
    b->recv(tensor.data_ptr(), tensor.nbytes(), src, tag, d);
    return {tensor};
  }, [] { return std::string(); }, dev);
}

}  // namespace tdist
