// How tdist's dtypes and reduce ops map onto NCCL's, the unique id's trip
// through the store, and NCCL's errors as tdist errors. Free of CUDA calls:
// all of it works (and is tested) on a machine without a GPU.
#pragma once

#include <nccl.h>

#include <chrono>
#include <string>

#include "comm/types.h"
#include "tdist/store.h"

namespace tdist::nccl {

// NCCL's type for t. kBool travels as uint8.
ncclDataType_t to_nccl(comm::DataType t);
// NCCL's op for op on t; UsageError naming `op_name` for what NCCL lacks
// (BAND, BOR, BXOR; AVG on integers). On bool, SUM is MAX and PRODUCT and
// MIN are MIN (logical or / and), as in torch.distributed.
ncclRedOp_t to_nccl(comm::ReduceOp op, comm::DataType t, const std::string& op_name);

// Rank 0 makes the communicator's unique id and publishes it under `key`;
// the others read it, waiting up to `timeout`. The id is network bootstrap
// only: this works without a GPU.
ncclUniqueId exchange_unique_id(Store& store, const std::string& key, int rank, std::chrono::milliseconds timeout);

// "ncclSystemError (...)" plus NCCL's last error text, when it has one.
std::string describe(ncclResult_t r);
// The NCCL library's version, "2.28.9".
std::string library_version();

}  // namespace tdist::nccl
