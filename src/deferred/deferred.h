// What the rest of the library uses of deferred initialization (the public
// face is include/tdist/deferred_init.h): materializing a named batch of
// tensors together, making them real but uninitialized (for a user's init
// function or a loader that fills every element), and pausing the mode
// while a deferred construction builds something real (an FSDP wrapper
// made inside a model's constructor).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <string>
#include <vector>

namespace tdist::detail {

struct NamedTensor {
  std::string name;  // for errors
  at::Tensor tensor;
};

// Every deferred tensor of `tensors`, together (a temporary two of them
// need is made once); the rest are left as they are. UsageError naming a
// meta tensor nothing recorded.
void materialize_named(const std::vector<NamedTensor>& tensors, std::optional<c10::Device> device);

// Every meta tensor of `tensors` becomes real on `device`, its elements
// unset (PyTorch's to_empty); they are final, as if materialized.
void empty_named(const std::vector<NamedTensor>& tensors, c10::Device device);

// While it lives, tensors are made for real and gradients recorded as
// outside the deferred_init around it (if any).
class DeferredInitPause {
 public:
  DeferredInitPause();

 private:
  c10::impl::ExcludeDispatchKeyGuard no_record_{c10::DispatchKey::DeferredInit};
  c10::AutoGradMode grad_;
};

}  // namespace tdist::detail
