// NCCL dtype/op mapping, unique-id exchange and error text. The contract is
// in nccl_types.h.
#include "nccl/nccl_types.h"

#include <cstring>

#include "tdist/errors.h"

namespace tdist::nccl {

ncclDataType_t to_nccl(comm::DataType t) {
  switch (t) {
    case comm::DataType::kFloat32: return ncclFloat32;
    case comm::DataType::kFloat64: return ncclFloat64;
    case comm::DataType::kFloat16: return ncclFloat16;
    case comm::DataType::kBFloat16: return ncclBfloat16;
    case comm::DataType::kInt8: return ncclInt8;
    case comm::DataType::kUInt8: return ncclUint8;
    case comm::DataType::kInt32: return ncclInt32;
    case comm::DataType::kInt64: return ncclInt64;
    case comm::DataType::kBool: return ncclUint8;
  }
  throw UsageError("nccl: unknown dtype " + std::to_string(static_cast<int>(t)));
}

ncclRedOp_t to_nccl(comm::ReduceOp op, comm::DataType t, const std::string& op_name) {
  const bool is_bool = t == comm::DataType::kBool;
  const bool is_float = t == comm::DataType::kFloat32 || t == comm::DataType::kFloat64 ||
                        t == comm::DataType::kFloat16 || t == comm::DataType::kBFloat16;
  switch (op) {
    case comm::ReduceOp::kSum: return is_bool ? ncclMax : ncclSum;
    case comm::ReduceOp::kProduct: return is_bool ? ncclMin : ncclProd;
    case comm::ReduceOp::kMin: return ncclMin;
    case comm::ReduceOp::kMax: return ncclMax;
    case comm::ReduceOp::kAvg:
      if (is_float) return ncclAvg;
      break;
    case comm::ReduceOp::kBand:
    case comm::ReduceOp::kBor:
    case comm::ReduceOp::kBxor: break;
  }
  throw UsageError(op_name + ": the nccl backend has no " + comm::reduce_op_name(op) + " on " + comm::dtype_name(t) +
                   " (NCCL reduces with SUM, PRODUCT, MIN, MAX, and AVG on floating types); use the gloo or shm "
                   "backend for it");
}

ncclUniqueId exchange_unique_id(Store& store, const std::string& key, int rank, std::chrono::milliseconds timeout) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) throw NetworkError("nccl: rank 0 could not make the communicator's unique id: " + describe(r));
    store.set(key, std::string_view(id.internal, sizeof id.internal));
    return id;
  }
  Bytes got;
  try {
    got = store.get(key, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError("nccl: rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) +
                       " ms for rank 0's NCCL unique id, which never came (" + e.what() + ")");
  }
  if (got.size() != sizeof id.internal) {
    throw NetworkError("nccl: rank " + std::to_string(rank) + " read a unique id of " + std::to_string(got.size()) +
                       " bytes from the store, not " + std::to_string(sizeof id.internal) +
                       "; is another job using the same store and group name?");
  }
  std::memcpy(id.internal, got.data(), got.size());
  return id;
}

std::string describe(ncclResult_t r) {
  std::string s = std::string(ncclGetErrorString(r)) + " (" + std::to_string(static_cast<int>(r)) + ")";
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') s += ": " + std::string(last);
  return s;
}

std::string library_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // 2.19 on: major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

}  // namespace tdist::nccl
