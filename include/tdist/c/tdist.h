/* tdist's C ABI: process groups and collectives for the language bindings
 * of LibTorch (tch-rs, TorchSharp, R torch, JavaCPP, torch.rb), which hold
 * a tensor as an opaque at::Tensor* and cross into LibTorch through C.
 *
 *   tdist_pg* pg = NULL;
 *   if (tdist_check_abi(TDIST_C_ABI_VERSION, NULL) != TDIST_OK ||
 *       tdist_init_process_group("auto", 60000, &pg) != TDIST_OK) {
 *     fprintf(stderr, "%s\n", tdist_last_error());
 *   }
 *   tdist_all_reduce(pg, t, TDIST_SUM, 60000);   t: the binding's at::Tensor*
 *   tdist_pg_free(pg);
 *
 * Contract:
 *   - Every call returns a tdist_status; on anything but TDIST_OK the
 *     message (naming the call, the rank where known, and why) is in
 *     tdist_last_error(), a thread-local string valid until this thread's
 *     next call. No C++ exception crosses this boundary.
 *   - Handles (tdist_pg, tdist_work) are opaque; a null, freed or foreign
 *     handle is TDIST_ERR_USAGE, never a crash (live handles are
 *     registered; freeing one twice is an error too).
 *   - Tensors are borrowed: a tdist_tensor is an at::Tensor* the caller
 *     owns (the handle every binding already holds); tdist never frees it.
 *     Tensors tdist makes (tdist_tensor_*) are the caller's to free with
 *     tdist_tensor_free.
 *   - Every blocking call takes a timeout in milliseconds (> 0; 0 means
 *     the group's default, 30 min unless TDIST_TIMEOUT_MS says otherwise
 *     at init) and returns TDIST_ERR_TIMEOUT past it.
 *   - tdist_check_abi: a binding built against another ABI version, or
 *     running on another LibTorch major.minor than tdist was built for,
 *     gets an error before it can crash. */
#ifndef TDIST_C_TDIST_H
#define TDIST_C_TDIST_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TDIST_C_ABI_VERSION 1

typedef enum {
  TDIST_OK = 0,
  TDIST_ERR_USAGE = 1,      /* a bad argument, handle or state */
  TDIST_ERR_TIMEOUT = 2,    /* a blocking call ran past its timeout */
  TDIST_ERR_COMM = 3,       /* a peer died, a collective failed or mismatched */
  TDIST_ERR_CHECKPOINT = 4, /* a file is missing, damaged or hostile */
  TDIST_ERR_INTERNAL = 5    /* anything else (the message says what) */
} tdist_status;

/* Ops and dtypes are passed as int (a binding's integer may hold any
 * value; an unknown one is TDIST_ERR_USAGE). */
typedef enum { TDIST_SUM = 0, TDIST_AVG, TDIST_PRODUCT, TDIST_MIN, TDIST_MAX } tdist_reduce_op;

typedef enum { TDIST_FLOAT32 = 0, TDIST_FLOAT64, TDIST_INT64, TDIST_INT32 } tdist_dtype;

typedef struct tdist_pg tdist_pg;
typedef struct tdist_work tdist_work;
typedef void* tdist_tensor; /* an at::Tensor* */

/* The message of this thread's last failed call ("" if none). */
const char* tdist_last_error(void);
int tdist_abi_version(void);
const char* tdist_version(void);
const char* tdist_torch_version(void);
/* abi_version: TDIST_C_ABI_VERSION as the binding was compiled; torch_version:
 * the LibTorch version the binding runs on ("2.5.1"), or NULL to skip. */
tdist_status tdist_check_abi(int abi_version, const char* torch_version);

/* The world group from the environment (tdist-run, torchrun, mpirun:
 * RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or OMPI_COMM_WORLD_*). backend:
 * "auto", "shm", "gloo", "mpi", "nccl" (NULL: "auto"). */
tdist_status tdist_init_process_group(const char* backend, int64_t timeout_ms, tdist_pg** out);
/* A subgroup of `pg` over `ranks` (ranks of pg); every rank of pg calls it.
 * A rank outside `ranks` gets *out = NULL and TDIST_OK. */
tdist_status tdist_new_group(tdist_pg* pg, const int* ranks, size_t n, tdist_pg** out);
tdist_status tdist_pg_free(tdist_pg* pg);
tdist_status tdist_pg_rank(tdist_pg* pg, int* out);
tdist_status tdist_pg_size(tdist_pg* pg, int* out);

/* Collectives, synchronous: done (or failed) when they return. */
tdist_status tdist_all_reduce(tdist_pg* pg, tdist_tensor t, int op, int64_t timeout_ms);
tdist_status tdist_broadcast(tdist_pg* pg, tdist_tensor t, int root, int64_t timeout_ms);
/* output: world size x input's numel, same dtype. */
tdist_status tdist_all_gather_into_tensor(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t timeout_ms);
tdist_status tdist_barrier(tdist_pg* pg, int64_t timeout_ms);

/* Asynchronous: *out is the op's work; wait on it, then free it. */
tdist_status tdist_all_reduce_async(tdist_pg* pg, tdist_tensor t, int op, int64_t timeout_ms,
                                    tdist_work** out);
tdist_status tdist_broadcast_async(tdist_pg* pg, tdist_tensor t, int root, int64_t timeout_ms, tdist_work** out);
tdist_status tdist_work_wait(tdist_work* w, int64_t timeout_ms);
/* *done: 1 when the op finished (successfully or not), else 0. */
tdist_status tdist_work_is_completed(tdist_work* w, int* done);
tdist_status tdist_work_free(tdist_work* w);

/* Tensors for callers with none of their own (a C program): 1-d, CPU. */
tdist_status tdist_tensor_from_data(const void* data, int64_t numel, int dtype, tdist_tensor* out);
tdist_status tdist_tensor_zeros(int64_t numel, int dtype, tdist_tensor* out);
/* Copies the tensor's elements (contiguous, as its dtype) into data, which holds `bytes`. */
tdist_status tdist_tensor_copy_to(tdist_tensor t, void* data, size_t bytes);
tdist_status tdist_tensor_free(tdist_tensor t);

#ifdef __cplusplus
}
#endif

#endif /* TDIST_C_TDIST_H */
