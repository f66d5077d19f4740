// Errors of the CUDA runtime as tdist errors, naming what was being done.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "tdist/errors.h"

namespace tdist::cuda {

inline void check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a sticky-less error so that later calls do not see it
  throw Error("CUDA error while " + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

}  // namespace tdist::cuda
