// The C ABI's tensors for C programs (include/tdist/c/tdist.h): made,
// read, freed, and the few ops with autograd that train a small model,
// each the LibTorch call the C++ API's modules and SGD make.
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/types.h>

#include <cstring>
#include <string>
#include <vector>

#include "c/c_core.h"

using namespace tdist::c;

namespace {

tdist_status unary(const char* call, tdist_tensor x, tdist_tensor* out, at::Tensor (*op)(const at::Tensor&)) {
  return guarded(call, [&] {
    out_check(out);
    *out = new_tensor(op(tensor(x, "input")));
  });
}

}  // namespace

extern "C" {

tdist_status tdist_tensor_from_data(const void* data, int64_t numel, int dtype, tdist_tensor* out) {
  return guarded("tdist_tensor_from_data", [&] {
    out_check(out);
    if (numel < 0) usage("numel is negative");
    if (!data && numel > 0) usage("data is NULL");
    const at::ScalarType d = dtype_of(dtype);
    at::Tensor t = at::empty({numel}, at::TensorOptions().dtype(d));
    if (numel > 0) std::memcpy(t.data_ptr(), data, static_cast<size_t>(numel) * t.element_size());
    *out = new_tensor(std::move(t));
  });
}

tdist_status tdist_tensor_zeros(int64_t numel, int dtype, tdist_tensor* out) {
  return guarded("tdist_tensor_zeros", [&] {
    out_check(out);
    if (numel < 0) usage("numel is negative");
    *out = new_tensor(at::zeros({numel}, at::TensorOptions().dtype(dtype_of(dtype))));
  });
}

tdist_status tdist_tensor_copy_to(tdist_tensor t, void* data, size_t bytes) {
  return guarded("tdist_tensor_copy_to", [&] {
    const at::Tensor c = tensor(t, "source").contiguous().cpu();
    const size_t need = static_cast<size_t>(c.numel()) * c.element_size();
    if (need > 0 && !data) usage("data is NULL");
    if (bytes != need) usage("the buffer holds " + std::to_string(bytes) + " bytes; the tensor has " + std::to_string(need));
    if (need > 0) std::memcpy(data, c.data_ptr(), need);
  });
}

tdist_status tdist_tensor_free(tdist_tensor t) {
  return guarded("tdist_tensor_free", [&] {
    if (!t) usage("the tensor is NULL");
    if (!registry().remove(t, Kind::kTensor)) usage("the tensor is not a live handle of its kind: freed already, another kind of handle, or not made by "
            "tdist (a binding's own tensors are its to free)");
    delete static_cast<at::Tensor*>(t);
  });
}

tdist_status tdist_tensor_new(const void* data, const int64_t* shape, size_t ndim, int dtype, int requires_grad,
                              tdist_tensor* out) {
  return guarded("tdist_tensor_new", [&] {
    out_check(out);
    if (ndim > 8) usage("ndim is " + std::to_string(ndim) + " (at most 8)");
    if (!shape && ndim > 0) usage("shape is NULL");
    std::vector<int64_t> sizes(shape, shape + ndim);
    int64_t numel = 1;
    for (int64_t d : sizes) {
      if (d < 0 || (d > 0 && numel > (int64_t{1} << 40) / d)) usage("a dimension is negative or the tensor is over 2^40 elements");
      numel *= d;
    }
    if (!data && numel > 0) usage("data is NULL");
    at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype_of(dtype)));
    if (numel > 0) std::memcpy(t.data_ptr(), data, static_cast<size_t>(numel) * t.element_size());
    if (requires_grad) t.requires_grad_(true);
    *out = new_tensor(std::move(t));
  });
}

tdist_status tdist_tensor_numel(tdist_tensor t, int64_t* out) {
  return guarded("tdist_tensor_numel", [&] {
    if (!out) usage("the output pointer is NULL");
    *out = tensor(t, "input").numel();
  });
}

tdist_status tdist_tensor_linear(tdist_tensor x, tdist_tensor w, tdist_tensor b, tdist_tensor* out) {
  return guarded("tdist_tensor_linear", [&] {
    out_check(out);
    const at::Tensor bias = b ? tensor(b, "bias") : at::Tensor();
    *out = new_tensor(at::linear(tensor(x, "input"), tensor(w, "weight"), bias));
  });
}

tdist_status tdist_tensor_relu(tdist_tensor x, tdist_tensor* out) {
  return unary("tdist_tensor_relu", x, out, [](const at::Tensor& t) { return at::relu(t); });
}

tdist_status tdist_tensor_tanh(tdist_tensor x, tdist_tensor* out) {
  return unary("tdist_tensor_tanh", x, out, [](const at::Tensor& t) { return at::tanh(t); });
}

tdist_status tdist_tensor_mse_loss(tdist_tensor y, tdist_tensor target, tdist_tensor* out) {
  return guarded("tdist_tensor_mse_loss", [&] {
    out_check(out);
    const at::Tensor& t = tensor(target, "target");
    *out = new_tensor(torch::mse_loss(tensor(y, "input").to(t.scalar_type()), t));
  });
}

tdist_status tdist_tensor_backward(tdist_tensor loss) {
  return guarded("tdist_tensor_backward", [&] {
    const at::Tensor& l = tensor(loss, "loss");
    if (l.numel() != 1) usage("backward needs a scalar loss (it has " + std::to_string(l.numel()) + " elements)");
    l.backward();
  });
}

tdist_status tdist_tensor_sgd_step(const tdist_tensor* params, size_t n, double lr) {
  return guarded("tdist_tensor_sgd_step", [&] {
    std::vector<at::Tensor> ps = tensors(params, n, "parameter");
    at::NoGradGuard no_grad;
    for (at::Tensor& p : ps) {
      if (p.grad().defined()) p.add_(p.grad(), -lr);
    }
    for (at::Tensor& p : ps) p.mutable_grad().reset();
  });
}

}  // extern "C"
