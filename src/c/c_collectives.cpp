// The C ABI's collectives (include/tdist/c/tdist.h): each op is written
// once, as a launch that takes whether it is asynchronous; its synchronous
// entry runs on the caller's thread (async_op = false), as the C++ API's
// does, and its _async entry hands out the Work.
#include <ATen/core/Tensor.h>

#include "c/c_core.h"

using namespace tdist;
using namespace tdist::c;

namespace {

ProcessGroup& group(tdist_pg* pg) { return *live(pg, "process group")->pg; }

template <typename Launch>
tdist_status sync_op(const char* call, Launch&& launch) {
  return guarded(call, [&] { launch(false); });
}
template <typename Launch>
tdist_status async_op(const char* call, tdist_work** out, Launch&& launch) {
  return guarded(call, [&] {
    out_check(out);
    tdist_work* h = reserve_work();  // before the op starts: no op runs without its handle
    try {
      publish_work(h, launch(true));
    } catch (...) {
      unreserve_work(h);
      throw;
    }
    *out = h;
  });
}

template <typename O>
O options(int64_t timeout_ms, bool async) {
  O o;
  o.timeout = timeout_of(timeout_ms);
  o.async_op = async;
  return o;
}

auto all_reduce(tdist_pg* pg, tdist_tensor t, int op, int64_t ms) {
  return [=](bool a) {
    auto o = options<AllreduceOptions>(ms, a);
    o.op = op_of(op);
    return group(pg).all_reduce(tensor(t, "input"), o);
  };
}
auto all_reduce_coalesced(tdist_pg* pg, const tdist_tensor* ts, size_t n, int op, int64_t ms) {
  return [=](bool a) {
    auto o = options<AllreduceOptions>(ms, a);
    o.op = op_of(op);
    const auto list = tensors(ts, n, "input");
    if (list.empty()) usage("no tensors");
    return group(pg).all_reduce_coalesced(list, o);
  };
}
auto all_gather_coalesced(tdist_pg* pg, const tdist_tensor* outputs, const tdist_tensor* inputs, size_t n,
                          int64_t ms) {
  return [=](bool a) {
    return group(pg).all_gather_into_tensor_coalesced(tensors(outputs, n, "output"), tensors(inputs, n, "input"),
                                                      options<CollectiveOptions>(ms, a));
  };
}
auto reduce_scatter_coalesced(tdist_pg* pg, const tdist_tensor* outputs, const tdist_tensor* inputs, size_t n,
                              int op, int64_t ms) {
  return [=](bool a) {
    auto o = options<ReduceScatterOptions>(ms, a);
    o.op = op_of(op);
    return group(pg).reduce_scatter_tensor_coalesced(tensors(outputs, n, "output"), tensors(inputs, n, "input"), o);
  };
}
auto broadcast(tdist_pg* pg, tdist_tensor t, int root, int64_t ms) {
  return [=](bool a) {
    auto o = options<BroadcastOptions>(ms, a);
    o.root = root;
    return group(pg).broadcast(tensor(t, "input"), o);
  };
}
auto reduce(tdist_pg* pg, tdist_tensor t, int root, int op, int64_t ms) {
  return [=](bool a) {
    auto o = options<ReduceOptions>(ms, a);
    o.root = root;
    o.op = op_of(op);
    return group(pg).reduce(tensor(t, "input"), o);
  };
}
auto all_gather_into_tensor(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t ms) {
  return [=](bool a) {
    return group(pg).all_gather_into_tensor(tensor(output, "output"), tensor(input, "input"),
                                            options<CollectiveOptions>(ms, a));
  };
}
auto all_gather(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input, int64_t ms) {
  return [=](bool a) {
    return group(pg).all_gather(tensors(outputs, n, "output"), tensor(input, "input"),
                                options<CollectiveOptions>(ms, a));
  };
}
auto reduce_scatter_tensor(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int op, int64_t ms) {
  return [=](bool a) {
    auto o = options<ReduceScatterOptions>(ms, a);
    o.op = op_of(op);
    return group(pg).reduce_scatter_tensor(tensor(output, "output"), tensor(input, "input"), o);
  };
}
auto reduce_scatter(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n, int op, int64_t ms) {
  return [=](bool a) {
    auto o = options<ReduceScatterOptions>(ms, a);
    o.op = op_of(op);
    return group(pg).reduce_scatter(tensor(output, "output"), tensors(inputs, n, "input"), o);
  };
}
auto gather(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input, int root, int64_t ms) {
  return [=](bool a) {
    auto o = options<RootOptions>(ms, a);
    o.root = root;
    return group(pg).gather(tensors(outputs, n, "output"), tensor(input, "input"), o);
  };
}
auto scatter(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n, int root, int64_t ms) {
  return [=](bool a) {
    auto o = options<RootOptions>(ms, a);
    o.root = root;
    return group(pg).scatter(tensor(output, "output"), tensors(inputs, n, "input"), o);
  };
}
auto all_to_all_single(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t ms) {
  return [=](bool a) {
    ProcessGroup& g = group(pg);
    const at::Tensor& out = tensor(output, "output");
    const at::Tensor& in = tensor(input, "input");
    // Equal splits: checked here, before any rank sends (a mismatch found
    // by the backend would end the group).
    if (in.dim() == 0 || out.dim() == 0 || in.size(0) % g.size() != 0 || out.size(0) % g.size() != 0 ||
        out.numel() != in.numel()) {
      usage("equal splits need input and output of the same size, dim 0 divisible by the group's " +
            std::to_string(g.size()) + " ranks (input " + std::to_string(in.numel()) + " elements, output " +
            std::to_string(out.numel()) + ")");
    }
    return g.all_to_all_single(out, in, {}, {}, options<CollectiveOptions>(ms, a));
  };
}
auto all_to_all(tdist_pg* pg, const tdist_tensor* outputs, const tdist_tensor* inputs, size_t n, int64_t ms) {
  return [=](bool a) {
    return group(pg).all_to_all(tensors(outputs, n, "output"), tensors(inputs, n, "input"),
                                options<CollectiveOptions>(ms, a));
  };
}
auto barrier(tdist_pg* pg, int64_t ms) {
  return [=](bool a) {
    auto w = group(pg).barrier(options<CollectiveOptions>(ms, a));
    if (!a) w->wait();
    return w;
  };
}
auto send(tdist_pg* pg, tdist_tensor t, int dst, int tag, int64_t ms) {
  return [=](bool a) { return group(pg).send(tensor(t, "input"), dst, tag, options<CollectiveOptions>(ms, a)); };
}
auto recv(tdist_pg* pg, tdist_tensor t, int src, int tag, int64_t ms) {
  return [=](bool a) { return group(pg).recv(tensor(t, "output"), src, tag, options<CollectiveOptions>(ms, a)); };
}

}  // namespace

extern "C" {

tdist_status tdist_all_reduce(tdist_pg* pg, tdist_tensor t, int op, int64_t ms) {
  return sync_op("tdist_all_reduce", all_reduce(pg, t, op, ms));
}
tdist_status tdist_all_reduce_async(tdist_pg* pg, tdist_tensor t, int op, int64_t ms, tdist_work** out) {
  return async_op("tdist_all_reduce_async", out, all_reduce(pg, t, op, ms));
}
tdist_status tdist_all_reduce_coalesced(tdist_pg* pg, const tdist_tensor* ts, size_t n, int op, int64_t ms) {
  return sync_op("tdist_all_reduce_coalesced", all_reduce_coalesced(pg, ts, n, op, ms));
}
tdist_status tdist_all_reduce_coalesced_async(tdist_pg* pg, const tdist_tensor* ts, size_t n, int op, int64_t ms,
                                              tdist_work** out) {
  return async_op("tdist_all_reduce_coalesced_async", out, all_reduce_coalesced(pg, ts, n, op, ms));
}
tdist_status tdist_all_gather_into_tensor_coalesced(tdist_pg* pg, const tdist_tensor* outputs,
                                                    const tdist_tensor* inputs, size_t n, int64_t ms) {
  return sync_op("tdist_all_gather_into_tensor_coalesced", all_gather_coalesced(pg, outputs, inputs, n, ms));
}
tdist_status tdist_all_gather_into_tensor_coalesced_async(tdist_pg* pg, const tdist_tensor* outputs,
                                                          const tdist_tensor* inputs, size_t n, int64_t ms,
                                                          tdist_work** out) {
  return async_op("tdist_all_gather_into_tensor_coalesced_async", out, all_gather_coalesced(pg, outputs, inputs, n, ms));
}
tdist_status tdist_reduce_scatter_tensor_coalesced(tdist_pg* pg, const tdist_tensor* outputs,
                                                   const tdist_tensor* inputs, size_t n, int op, int64_t ms) {
  return sync_op("tdist_reduce_scatter_tensor_coalesced", reduce_scatter_coalesced(pg, outputs, inputs, n, op, ms));
}
tdist_status tdist_reduce_scatter_tensor_coalesced_async(tdist_pg* pg, const tdist_tensor* outputs,
                                                         const tdist_tensor* inputs, size_t n, int op, int64_t ms,
                                                         tdist_work** out) {
  return async_op("tdist_reduce_scatter_tensor_coalesced_async", out,
                  reduce_scatter_coalesced(pg, outputs, inputs, n, op, ms));
}
tdist_status tdist_broadcast(tdist_pg* pg, tdist_tensor t, int root, int64_t ms) {
  return sync_op("tdist_broadcast", broadcast(pg, t, root, ms));
}
tdist_status tdist_broadcast_async(tdist_pg* pg, tdist_tensor t, int root, int64_t ms, tdist_work** out) {
  return async_op("tdist_broadcast_async", out, broadcast(pg, t, root, ms));
}
tdist_status tdist_reduce(tdist_pg* pg, tdist_tensor t, int root, int op, int64_t ms) {
  return sync_op("tdist_reduce", reduce(pg, t, root, op, ms));
}
tdist_status tdist_reduce_async(tdist_pg* pg, tdist_tensor t, int root, int op, int64_t ms, tdist_work** out) {
  return async_op("tdist_reduce_async", out, reduce(pg, t, root, op, ms));
}
tdist_status tdist_all_gather_into_tensor(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t ms) {
  return sync_op("tdist_all_gather_into_tensor", all_gather_into_tensor(pg, output, input, ms));
}
tdist_status tdist_all_gather_into_tensor_async(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t ms,
                                                tdist_work** out) {
  return async_op("tdist_all_gather_into_tensor_async", out, all_gather_into_tensor(pg, output, input, ms));
}
tdist_status tdist_all_gather(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input, int64_t ms) {
  return sync_op("tdist_all_gather", all_gather(pg, outputs, n, input, ms));
}
tdist_status tdist_all_gather_async(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input,
                                    int64_t ms, tdist_work** out) {
  return async_op("tdist_all_gather_async", out, all_gather(pg, outputs, n, input, ms));
}
tdist_status tdist_reduce_scatter_tensor(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int op, int64_t ms) {
  return sync_op("tdist_reduce_scatter_tensor", reduce_scatter_tensor(pg, output, input, op, ms));
}
tdist_status tdist_reduce_scatter_tensor_async(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int op,
                                               int64_t ms, tdist_work** out) {
  return async_op("tdist_reduce_scatter_tensor_async", out, reduce_scatter_tensor(pg, output, input, op, ms));
}
tdist_status tdist_reduce_scatter(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n, int op,
                                  int64_t ms) {
  return sync_op("tdist_reduce_scatter", reduce_scatter(pg, output, inputs, n, op, ms));
}
tdist_status tdist_reduce_scatter_async(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n,
                                        int op, int64_t ms, tdist_work** out) {
  return async_op("tdist_reduce_scatter_async", out, reduce_scatter(pg, output, inputs, n, op, ms));
}
tdist_status tdist_gather(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input, int root,
                          int64_t ms) {
  return sync_op("tdist_gather", gather(pg, outputs, n, input, root, ms));
}
tdist_status tdist_gather_async(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input, int root,
                                int64_t ms, tdist_work** out) {
  return async_op("tdist_gather_async", out, gather(pg, outputs, n, input, root, ms));
}
tdist_status tdist_scatter(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n, int root,
                           int64_t ms) {
  return sync_op("tdist_scatter", scatter(pg, output, inputs, n, root, ms));
}
tdist_status tdist_scatter_async(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n, int root,
                                 int64_t ms, tdist_work** out) {
  return async_op("tdist_scatter_async", out, scatter(pg, output, inputs, n, root, ms));
}
tdist_status tdist_all_to_all_single(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t ms) {
  return sync_op("tdist_all_to_all_single", all_to_all_single(pg, output, input, ms));
}
tdist_status tdist_all_to_all_single_async(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t ms,
                                           tdist_work** out) {
  return async_op("tdist_all_to_all_single_async", out, all_to_all_single(pg, output, input, ms));
}
tdist_status tdist_all_to_all(tdist_pg* pg, const tdist_tensor* outputs, const tdist_tensor* inputs, size_t n,
                              int64_t ms) {
  return sync_op("tdist_all_to_all", all_to_all(pg, outputs, inputs, n, ms));
}
tdist_status tdist_all_to_all_async(tdist_pg* pg, const tdist_tensor* outputs, const tdist_tensor* inputs, size_t n,
                                    int64_t ms, tdist_work** out) {
  return async_op("tdist_all_to_all_async", out, all_to_all(pg, outputs, inputs, n, ms));
}
tdist_status tdist_barrier(tdist_pg* pg, int64_t ms) { return sync_op("tdist_barrier", barrier(pg, ms)); }
tdist_status tdist_barrier_async(tdist_pg* pg, int64_t ms, tdist_work** out) {
  return async_op("tdist_barrier_async", out, barrier(pg, ms));
}
tdist_status tdist_send(tdist_pg* pg, tdist_tensor t, int dst, int tag, int64_t ms) {
  return sync_op("tdist_send", send(pg, t, dst, tag, ms));
}
tdist_status tdist_send_async(tdist_pg* pg, tdist_tensor t, int dst, int tag, int64_t ms, tdist_work** out) {
  return async_op("tdist_send_async", out, send(pg, t, dst, tag, ms));
}
tdist_status tdist_recv(tdist_pg* pg, tdist_tensor t, int src, int tag, int64_t ms) {
  return sync_op("tdist_recv", recv(pg, t, src, tag, ms));
}
tdist_status tdist_recv_async(tdist_pg* pg, tdist_tensor t, int src, int tag, int64_t ms, tdist_work** out) {
  return async_op("tdist_recv_async", out, recv(pg, t, src, tag, ms));
}

}  // extern "C"
