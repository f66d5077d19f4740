// tdist's C ABI (include/tdist/c/tdist.h): handles, statuses, the
// thread-local last error. Every entry point runs its body through
// guarded(), so no exception crosses into C.
#include "tdist/c/tdist.h"

#include <ATen/ATen.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "tdist/errors.h"
#include "tdist/process_group.h"
#include "tdist/version.h"

struct tdist_pg {
  std::shared_ptr<tdist::ProcessGroup> pg;
};
struct tdist_work {
  std::shared_ptr<tdist::Work> work;
};

namespace {

thread_local std::string last_error;

// A failure to report: the status and its message.
struct CFailure {
  tdist_status status;
  std::string what;
};

[[noreturn]] void usage(const std::string& what) { throw CFailure{TDIST_ERR_USAGE, what}; }

// Live handles (pg, work, tensors tdist made): a null, freed or foreign
// one is an error, not a dereference.
class Registry {
 public:
  void add(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(p);
  }
  bool remove(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.erase(p) == 1;
  }
  bool has(const void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.count(p) == 1;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_set<const void*> live_;
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: handles may outlive static destruction
  return *r;
}

template <typename T>
T* live(T* h, const char* what) {
  if (!h) usage(std::string("the ") + what + " is NULL");
  if (!registry().has(h)) usage(std::string("the ") + what + " is not a live handle (freed, or not made by tdist)");
  return h;
}

at::Tensor& tensor(tdist_tensor t, const char* what) {
  if (!t) usage(std::string("the ") + what + " tensor is NULL");
  auto* p = static_cast<at::Tensor*>(t);
  if (!p->defined()) usage(std::string("the ") + what + " tensor is undefined");
  return *p;
}

std::optional<tdist::Milliseconds> timeout_of(int64_t ms) {
  if (ms < 0) usage("the timeout is negative (" + std::to_string(ms) + " ms)");
  if (ms == 0) return std::nullopt;
  return tdist::Milliseconds(ms);
}

tdist::ReduceOp op_of(int op) {
  switch (op) {
    case TDIST_SUM: return tdist::ReduceOp::SUM;
    case TDIST_AVG: return tdist::ReduceOp::AVG;
    case TDIST_PRODUCT: return tdist::ReduceOp::PRODUCT;
    case TDIST_MIN: return tdist::ReduceOp::MIN;
    case TDIST_MAX: return tdist::ReduceOp::MAX;
  }
  usage("unknown reduce op " + std::to_string(op));
}

at::ScalarType dtype_of(int d) {
  switch (d) {
    case TDIST_FLOAT32: return at::kFloat;
    case TDIST_FLOAT64: return at::kDouble;
    case TDIST_INT64: return at::kLong;
    case TDIST_INT32: return at::kInt;
  }
  usage("unknown dtype " + std::to_string(d));
}

tdist_status fail(tdist_status s, const char* call, const std::string& what) {
  last_error = std::string(call) + ": " + what;
  return s;
}

template <typename Fn>
tdist_status guarded(const char* call, Fn&& fn) {
  try {
    fn();
    last_error.clear();
    return TDIST_OK;
  } catch (const CFailure& f) {
    return fail(f.status, call, f.what);
  } catch (const tdist::TimeoutError& e) {
    return fail(TDIST_ERR_TIMEOUT, call, e.what());
  } catch (const tdist::UsageError& e) {
    return fail(TDIST_ERR_USAGE, call, e.what());
  } catch (const tdist::CheckpointError& e) {
    return fail(TDIST_ERR_CHECKPOINT, call, e.what());
  } catch (const tdist::Error& e) {  // peers, the network, the store, mismatched collectives
    return fail(TDIST_ERR_COMM, call, e.what());
  } catch (const c10::Error& e) {  // LibTorch refused the tensors (dtype, shape, device)
    return fail(TDIST_ERR_USAGE, call, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(TDIST_ERR_INTERNAL, call, e.what());
  } catch (...) {
    return fail(TDIST_ERR_INTERNAL, call, "an unknown exception");
  }
}

template <typename T>
void out_check(T** out) {
  if (!out) usage("the output pointer is NULL");
  *out = nullptr;
}

tdist_work* new_work(std::shared_ptr<tdist::Work> w) {
  auto* h = new tdist_work{std::move(w)};
  registry().add(h);
  return h;
}

tdist_tensor new_tensor(at::Tensor t) {
  auto* h = new at::Tensor(std::move(t));
  registry().add(h);
  return h;
}

}  // namespace

extern "C" {

const char* tdist_last_error(void) { return last_error.c_str(); }
int tdist_abi_version(void) { return TDIST_C_ABI_VERSION; }

const char* tdist_version(void) {
  static const std::string v = tdist::version();
  return v.c_str();
}

const char* tdist_torch_version(void) {
  static const std::string v = tdist::torch_version();
  return v.c_str();
}

tdist_status tdist_check_abi(int abi_version, const char* torch_version) {
  return guarded("tdist_check_abi", [&] {
    if (abi_version != TDIST_C_ABI_VERSION) {
      usage("the binding was built for tdist's C ABI " + std::to_string(abi_version) + "; this libtdist_c is ABI " +
            std::to_string(TDIST_C_ABI_VERSION) + " (tdist " + tdist::version() + "): rebuild it");
    }
    if (!torch_version) return;
    const auto major_minor = [](const std::string& v) {
      const size_t dot = v.find('.');
      return dot == std::string::npos ? v : v.substr(0, v.find('.', dot + 1));
    };
    const std::string mine = tdist::torch_version();
    if (major_minor(torch_version) != major_minor(mine)) {
      usage(std::string("the binding runs on LibTorch ") + torch_version + "; tdist was built against " + mine +
            " (at::Tensor's layout may differ): use a tdist built for it");
    }
  });
}

tdist_status tdist_init_process_group(const char* backend, int64_t timeout_ms, tdist_pg** out) {
  return guarded("tdist_init_process_group", [&] {
    out_check(out);
    tdist::InitOptions o;
    if (backend) o.backend = backend;
    if (const auto t = timeout_of(timeout_ms)) o.timeout = *t;
    auto* h = new tdist_pg{tdist::init_process_group(o)};
    registry().add(h);
    *out = h;
  });
}

tdist_status tdist_new_group(tdist_pg* pg, const int* ranks, size_t n, tdist_pg** out) {
  return guarded("tdist_new_group", [&] {
    out_check(out);
    live(pg, "process group");
    if (!ranks && n > 0) usage("ranks is NULL");
    auto g = pg->pg->new_group(std::vector<int>(ranks, ranks + n));
    if (!g) return;  // not a member
    auto* h = new tdist_pg{std::move(g)};
    registry().add(h);
    *out = h;
  });
}

tdist_status tdist_pg_free(tdist_pg* pg) {
  return guarded("tdist_pg_free", [&] {
    if (!pg) usage("the process group is NULL");
    if (!registry().remove(pg)) usage("the process group is not a live handle (freed twice?)");
    if (tdist::default_group() == pg->pg) tdist::destroy_process_group();
    delete pg;
  });
}

tdist_status tdist_pg_rank(tdist_pg* pg, int* out) {
  return guarded("tdist_pg_rank", [&] {
    if (!out) usage("the output pointer is NULL");
    *out = live(pg, "process group")->pg->rank();
  });
}

tdist_status tdist_pg_size(tdist_pg* pg, int* out) {
  return guarded("tdist_pg_size", [&] {
    if (!out) usage("the output pointer is NULL");
    *out = live(pg, "process group")->pg->size();
  });
}

tdist_status tdist_all_reduce(tdist_pg* pg, tdist_tensor t, int op, int64_t timeout_ms) {
  return guarded("tdist_all_reduce", [&] {
    tdist::AllreduceOptions o;
    o.op = op_of(op);
    o.timeout = timeout_of(timeout_ms);
    o.async_op = false;
    live(pg, "process group")->pg->all_reduce(tensor(t, "input"), o);
  });
}

tdist_status tdist_broadcast(tdist_pg* pg, tdist_tensor t, int root, int64_t timeout_ms) {
  return guarded("tdist_broadcast", [&] {
    tdist::BroadcastOptions o;
    o.root = root;
    o.timeout = timeout_of(timeout_ms);
    o.async_op = false;
    live(pg, "process group")->pg->broadcast(tensor(t, "input"), o);
  });
}

tdist_status tdist_all_gather_into_tensor(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t timeout_ms) {
  return guarded("tdist_all_gather_into_tensor", [&] {
    tdist::CollectiveOptions o;
    o.timeout = timeout_of(timeout_ms);
    o.async_op = false;
    live(pg, "process group")->pg->all_gather_into_tensor(tensor(output, "output"), tensor(input, "input"), o);
  });
}

tdist_status tdist_barrier(tdist_pg* pg, int64_t timeout_ms) {
  return guarded("tdist_barrier", [&] {
    tdist::CollectiveOptions o;
    o.timeout = timeout_of(timeout_ms);
    live(pg, "process group")->pg->barrier(o)->wait();
  });
}

tdist_status tdist_all_reduce_async(tdist_pg* pg, tdist_tensor t, int op, int64_t timeout_ms,
                                    tdist_work** out) {
  return guarded("tdist_all_reduce_async", [&] {
    out_check(out);
    tdist::AllreduceOptions o;
    o.op = op_of(op);
    o.timeout = timeout_of(timeout_ms);
    *out = new_work(live(pg, "process group")->pg->all_reduce(tensor(t, "input"), o));
  });
}

tdist_status tdist_broadcast_async(tdist_pg* pg, tdist_tensor t, int root, int64_t timeout_ms, tdist_work** out) {
  return guarded("tdist_broadcast_async", [&] {
    out_check(out);
    tdist::BroadcastOptions o;
    o.root = root;
    o.timeout = timeout_of(timeout_ms);
    *out = new_work(live(pg, "process group")->pg->broadcast(tensor(t, "input"), o));
  });
}

tdist_status tdist_work_wait(tdist_work* w, int64_t timeout_ms) {
  return guarded("tdist_work_wait", [&] {
    const auto t = timeout_of(timeout_ms);
    auto& work = *live(w, "work")->work;
    if (t) {
      work.wait(*t);
    } else {
      work.wait();
    }
  });
}

tdist_status tdist_work_is_completed(tdist_work* w, int* done) {
  return guarded("tdist_work_is_completed", [&] {
    if (!done) usage("the output pointer is NULL");
    *done = live(w, "work")->work->is_completed() ? 1 : 0;
  });
}

tdist_status tdist_work_free(tdist_work* w) {
  return guarded("tdist_work_free", [&] {
    if (!w) usage("the work is NULL");
    if (!registry().remove(w)) usage("the work is not a live handle (freed twice?)");
    delete w;
  });
}

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
    if (!registry().remove(t)) usage("the tensor was not made by tdist, or is freed already (a binding's own tensors are its to free)");
    delete static_cast<at::Tensor*>(t);
  });
}

}  // extern "C"
