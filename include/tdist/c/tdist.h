/* tdist's C ABI: process groups, collectives, DDP, FSDP, state dicts and
 * checkpoints for the language bindings of LibTorch (tch-rs, TorchSharp,
 * R torch, JavaCPP, torch.rb), which cross into LibTorch through C and
 * hold tensors as at::Tensor* (docs/bindings.md: which pointer each passes).
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
 *   - Handles (tdist_pg, tdist_work, tdist_module, ...) are opaque; a null,
 *     freed or foreign handle is TDIST_ERR_USAGE, never a crash (live
 *     handles are registered; freeing one twice is an error too).
 *   - Tensors are borrowed: a tdist_tensor is an at::Tensor* the caller
 *     owns (tch-rs, TorchSharp and JavaCPP hold exactly that; R torch and
 *     torch.rb wrap it); tdist never frees it. Tensors tdist makes
 *     (tdist_tensor_*, tdist_fsdp_cast_input) are the caller's to free with
 *     tdist_tensor_free; those in a tdist_tensor_list are the list's. The
 *     caller's LibTorch must be the one tdist was built against (same
 *     major.minor, same C++ ABI, loaded once in the process).
 *   - Every collective takes a timeout in milliseconds (> 0; 0 means the
 *     group's, 30 min unless TDIST_TIMEOUT_MS says otherwise at init) and
 *     returns TDIST_ERR_TIMEOUT past it (over 10^12 ms, 31 years, counts as
 *     10^12: INT64_MAX is "no limit"). Calls without one (DDP, FSDP, state
 *     dicts) wait at most their group's timeout; sharded checkpoints and the
 *     Checkpointer at most 5 minutes per step of a save or load.
 *   - Not thread-safe per handle: one thread drives a module's DDP or FSDP
 *     (other threads may run other groups' collectives).
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

typedef enum { TDIST_FLOAT32 = 0, TDIST_FLOAT64, TDIST_INT64, TDIST_INT32, TDIST_BFLOAT16, TDIST_FLOAT16 } tdist_dtype;

typedef struct tdist_store tdist_store;               /* a key-value store: TCPStore, FileStore */
typedef struct tdist_pg tdist_pg;
typedef struct tdist_work tdist_work;
typedef struct tdist_module tdist_module;             /* the binding's model: its tensors by name */
typedef struct tdist_ddp tdist_ddp;                   /* DistributedDataParallel over a tdist_module */
typedef struct tdist_fsdp tdist_fsdp;                 /* one FSDP unit (fully_shard of a submodule) */
typedef struct tdist_join tdist_join;                 /* Join: training on uneven inputs */
typedef struct tdist_tensor_list tdist_tensor_list;   /* names -> tensors that tdist made */
typedef struct tdist_checkpointer tdist_checkpointer; /* periodic saves, automatic resume */
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
/* ---- stores (torch.distributed's TCPStore and FileStore) -----------------
 * TCPStore: is_server 1 on the master (port 0: a free one, which
 * tdist_store_port tells), the others connect to host:port; num_workers
 * (> 0, on the server) waits for that many clients, itself included.
 * timeout_ms: the store's blocking calls' default, and how long a client
 * retries connecting. The job's token, if any, comes from TDIST_STORE_TOKEN
 * as in C++ (docs/security.md). FileStore: every rank opens the same path
 * (fresh for each job). */
tdist_status tdist_tcp_store_new(const char* host, int port, int is_server, int num_workers, int64_t timeout_ms,
                                 tdist_store** out);
tdist_status tdist_file_store_new(const char* path, int64_t timeout_ms, tdist_store** out);
tdist_status tdist_store_port(tdist_store* s, int* port);
tdist_status tdist_store_set(tdist_store* s, const char* key, const void* value, size_t n);
/* Waits (timeout_ms; 0: the store's) for key; *n is the value's size, and
 * the value is copied when it fits in cap bytes (else TDIST_ERR_USAGE,
 * *n still set: call again with a buffer that large). */
tdist_status tdist_store_get(tdist_store* s, const char* key, void* value, size_t cap, size_t* n, int64_t timeout_ms);
/* Adds delta to the integer at key (0 when missing); *result: the sum. */
tdist_status tdist_store_add(tdist_store* s, const char* key, int64_t delta, int64_t* result);
tdist_status tdist_store_wait(tdist_store* s, const char* const* keys, size_t n, int64_t timeout_ms);
tdist_status tdist_store_free(tdist_store* s);
/* The world group over a store the caller made (every rank gives its rank
 * and the world size), instead of the environment. */
tdist_status tdist_init_process_group_with_store(tdist_store* s, int rank, int world_size, const char* backend,
                                                 int64_t timeout_ms, tdist_pg** out);

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

/* Each tensor reduced in place as one op (one dtype for all). */
tdist_status tdist_all_reduce_coalesced(tdist_pg* pg, const tdist_tensor* ts, size_t n, int op, int64_t timeout_ms);
/* all_gather_into_tensor / reduce_scatter_tensor of each pair
 * (outputs[k], inputs[k]) as one op (FSDP's pattern). */
tdist_status tdist_all_gather_into_tensor_coalesced(tdist_pg* pg, const tdist_tensor* outputs,
                                                    const tdist_tensor* inputs, size_t n, int64_t timeout_ms);
tdist_status tdist_reduce_scatter_tensor_coalesced(tdist_pg* pg, const tdist_tensor* outputs,
                                                   const tdist_tensor* inputs, size_t n, int op, int64_t timeout_ms);

/* Asynchronous: *out is the op's work; wait on it, then free it. */
tdist_status tdist_all_reduce_async(tdist_pg* pg, tdist_tensor t, int op, int64_t timeout_ms,
                                    tdist_work** out);
tdist_status tdist_broadcast_async(tdist_pg* pg, tdist_tensor t, int root, int64_t timeout_ms, tdist_work** out);
tdist_status tdist_work_wait(tdist_work* w, int64_t timeout_ms);
/* *done: 1 when the op finished (successfully or not), else 0. */
tdist_status tdist_work_is_completed(tdist_work* w, int* done);
tdist_status tdist_work_free(tdist_work* w);

/* More collectives, each synchronous and asynchronous (_async: *out is the
 * op's work). Lists are arrays of n tensors; the semantics are those of
 * torch.distributed's calls of the same names. */
tdist_status tdist_reduce(tdist_pg* pg, tdist_tensor t, int root, int op, int64_t timeout_ms);
tdist_status tdist_reduce_async(tdist_pg* pg, tdist_tensor t, int root, int op, int64_t timeout_ms, tdist_work** out);
tdist_status tdist_all_gather_into_tensor_async(tdist_pg* pg, tdist_tensor output, tdist_tensor input,
                                                int64_t timeout_ms, tdist_work** out);
/* outputs: n == world size tensors shaped like input. */
tdist_status tdist_all_gather(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input,
                              int64_t timeout_ms);
tdist_status tdist_all_gather_async(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input,
                                    int64_t timeout_ms, tdist_work** out);
/* output = op over ranks of their input's rank()-th slice (input: world size x output's numel). */
tdist_status tdist_reduce_scatter_tensor(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int op,
                                         int64_t timeout_ms);
tdist_status tdist_reduce_scatter_tensor_async(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int op,
                                               int64_t timeout_ms, tdist_work** out);
/* output = op over ranks of their inputs[rank()] (n == world size). */
tdist_status tdist_reduce_scatter(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n, int op,
                                  int64_t timeout_ms);
tdist_status tdist_reduce_scatter_async(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n,
                                        int op, int64_t timeout_ms, tdist_work** out);
/* On root, outputs[r] = rank r's input (n == world size); elsewhere n == 0. */
tdist_status tdist_gather(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input, int root,
                          int64_t timeout_ms);
tdist_status tdist_gather_async(tdist_pg* pg, const tdist_tensor* outputs, size_t n, tdist_tensor input, int root,
                                int64_t timeout_ms, tdist_work** out);
/* output = root's inputs[rank()] (n == world size on root, 0 elsewhere). */
tdist_status tdist_scatter(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n, int root,
                           int64_t timeout_ms);
tdist_status tdist_scatter_async(tdist_pg* pg, tdist_tensor output, const tdist_tensor* inputs, size_t n, int root,
                                 int64_t timeout_ms, tdist_work** out);
/* Equal splits along dim 0 (uneven: the C++ API). */
tdist_status tdist_all_to_all_single(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t timeout_ms);
tdist_status tdist_all_to_all_single_async(tdist_pg* pg, tdist_tensor output, tdist_tensor input, int64_t timeout_ms,
                                           tdist_work** out);
/* outputs[r] = rank r's inputs[rank()] (n == world size, both). */
tdist_status tdist_all_to_all(tdist_pg* pg, const tdist_tensor* outputs, const tdist_tensor* inputs, size_t n,
                              int64_t timeout_ms);
tdist_status tdist_all_to_all_async(tdist_pg* pg, const tdist_tensor* outputs, const tdist_tensor* inputs, size_t n,
                                    int64_t timeout_ms, tdist_work** out);
tdist_status tdist_barrier_async(tdist_pg* pg, int64_t timeout_ms, tdist_work** out);
tdist_status tdist_all_reduce_coalesced_async(tdist_pg* pg, const tdist_tensor* ts, size_t n, int op,
                                              int64_t timeout_ms, tdist_work** out);
tdist_status tdist_all_gather_into_tensor_coalesced_async(tdist_pg* pg, const tdist_tensor* outputs,
                                                          const tdist_tensor* inputs, size_t n, int64_t timeout_ms,
                                                          tdist_work** out);
tdist_status tdist_reduce_scatter_tensor_coalesced_async(tdist_pg* pg, const tdist_tensor* outputs,
                                                         const tdist_tensor* inputs, size_t n, int op,
                                                         int64_t timeout_ms, tdist_work** out);
tdist_status tdist_send(tdist_pg* pg, tdist_tensor t, int dst, int tag, int64_t timeout_ms);
tdist_status tdist_send_async(tdist_pg* pg, tdist_tensor t, int dst, int tag, int64_t timeout_ms, tdist_work** out);
tdist_status tdist_recv(tdist_pg* pg, tdist_tensor t, int src, int tag, int64_t timeout_ms);
tdist_status tdist_recv_async(tdist_pg* pg, tdist_tensor t, int src, int tag, int64_t timeout_ms, tdist_work** out);

/* ---- the binding's model --------------------------------------------------
 * A tdist_module is the binding's own module seen by tdist: its parameters
 * (and buffers) by their dotted names ("fc1.weight", "layers.0.bias"), in
 * the binding's registration order. tdist holds the binding's tensors
 * themselves (the same TensorImpl, no copy): gradients the binding's
 * backward() computes are the ones DDP and FSDP reduce, and what DDP
 * broadcasts or FSDP shards is what the binding's forward reads. Names say
 * the module tree: "a.b.w" is parameter w of submodule b of submodule a.
 * The module is in training mode until tdist_module_set_training says
 * otherwise (FSDP frees a unit's gathered parameters after an eval forward). */
tdist_status tdist_module_new(const char* const* names, const tdist_tensor* params, size_t n, tdist_module** out);
tdist_status tdist_module_add_buffers(tdist_module* m, const char* const* names, const tdist_tensor* buffers,
                                      size_t n);
tdist_status tdist_module_set_training(tdist_module* m, int training);
/* Frees the handle; DDP and FSDP handles made over it keep what they need. */
tdist_status tdist_module_free(tdist_module* m);

/* ---- DistributedDataParallel ----------------------------------------------
 * Around each forward of the binding's module:
 *   tdist_ddp_pre_forward(ddp);           buffers broadcast, a Join notified
 *   y = the binding's forward(x);
 *   tdist_ddp_post_forward(ddp, &y, 1);   with find_unused_parameters: the graph walked
 *   the binding's loss.backward()          buckets all-reduced as gradients come
 * When backward returns the gradients are averaged over ranks. Construction
 * checks that every rank has the same parameters (names, shapes, dtypes)
 * and broadcasts rank 0's parameters and buffers (collective). */
typedef struct {
  size_t struct_size; /* sizeof(tdist_ddp_options), set by tdist_ddp_options_init */
  double bucket_cap_mb;       /* 25 */
  double first_bucket_cap_mb; /* 1 */
  int broadcast_buffers;      /* 1 */
  int find_unused_parameters; /* 0 */
  int gradient_as_bucket_view; /* 0 */
  int static_graph;           /* 0 */
} tdist_ddp_options;
void tdist_ddp_options_init(tdist_ddp_options* o);
/* pg: NULL for the default group; o: NULL for the defaults. */
tdist_status tdist_ddp_new(tdist_module* m, tdist_pg* pg, const tdist_ddp_options* o, tdist_ddp** out);
tdist_status tdist_ddp_pre_forward(tdist_ddp* d);
tdist_status tdist_ddp_post_forward(tdist_ddp* d, const tdist_tensor* outputs, size_t n);
/* no_sync: with 0, the backward of the forwards that follow only
 * accumulates .grad locally (decided at forward time); with 1 again, the
 * next backward synchronises everything. */
tdist_status tdist_ddp_set_require_sync(tdist_ddp* d, int require_sync);
/* Comm hooks by name, once, before training: "allreduce", "fp16", "bf16",
 * "noop", or "powersgd" (matrix_approximation_rank 1, start_powersgd_iter
 * 1000, error feedback and warm start on, as PyTorch's PowerSGDState; the
 * variant "powersgd:RANK:START_ITER" sets the two). group: the hook's group
 * (NULL: DDP's). */
tdist_status tdist_ddp_register_comm_hook(tdist_ddp* d, const char* hook, tdist_pg* group);
tdist_status tdist_ddp_free(tdist_ddp* d);

/* ---- FSDP: fully_shard, one call per unit ----------------------------------
 * FSDP2's shape: shard the inner submodules first, the root last:
 *   for each layer i:  tdist_fully_shard(m, "layers.i", pg, &o, &unit[i]);
 *   tdist_fully_shard(m, "", pg, &o, &root);      the rest: the root's unit
 * Each unit owns the parameters under its path that no inner unit owns.
 * Between iterations every such tensor of the binding is this rank's shard
 * (rows [r * ceil(rows / N), ...) of dim 0), so the binding's optimizer,
 * built on the same tensors, steps shards. The binding calls, around the
 * forward of the submodule a unit wraps:
 *   tdist_fsdp_pre_forward(unit);                 gathers the full parameters
 *   y = the submodule's forward(x);
 *   tdist_fsdp_post_forward(unit, &y, 1);         frees them, hooks y's backward
 * (tdist_fsdp_abort_forward if the forward failed). backward() then
 * gathers, computes and reduce-scatters the gradients into the shards'
 * .grad, unit by unit. Collective: every rank makes the same calls in the
 * same order. */
typedef enum {
  TDIST_FULL_SHARD = 0,
  TDIST_SHARD_GRAD_OP,
  TDIST_NO_SHARD,
  TDIST_HYBRID_SHARD,
  TDIST_HYBRID_SHARD_ZERO2
} tdist_sharding_strategy;
typedef struct {
  size_t struct_size;          /* sizeof(tdist_fsdp_options), set by tdist_fsdp_options_init */
  int sharding_strategy;       /* TDIST_FULL_SHARD */
  int reshard_after_forward;   /* -1: as the strategy says; 0: keep; 1: free; k > 1: keep 1/k (hpZ) */
  int param_dtype;             /* -1: the parameters' own; else a tdist_dtype (mixed precision) */
  int reduce_dtype;            /* -1: param_dtype */
  int buffer_dtype;            /* -1: unchanged */
  int cast_forward_inputs;     /* 1: tdist_fsdp_cast_input converts to param_dtype */
  int backward_prefetch;       /* 1: BACKWARD_PRE; 0: NONE */
  int forward_prefetch;        /* 0 */
  int sync_module_states;      /* 1: rank 0's values broadcast when the unit is made */
  int hybrid_shard_size;       /* hybrid strategies: ranks that shard together (0: LOCAL_WORLD_SIZE) */
} tdist_fsdp_options;
void tdist_fsdp_options_init(tdist_fsdp_options* o);
/* path: the submodule's dotted name ("" for the root). Its unit handle
 * stays valid as long as the module's units; free each with tdist_fsdp_free
 * after training (freeing one does not unshard the others). */
tdist_status tdist_fully_shard(tdist_module* m, const char* path, tdist_pg* pg, const tdist_fsdp_options* o,
                               tdist_fsdp** out);
/* The same, naming the unit by its parameters (handles given to
 * tdist_module_new): the deepest submodule whose parameters, those of its
 * inner units aside, are exactly these (n = 0: the root, once every
 * parameter is in an inner unit). */
tdist_status tdist_fully_shard_tensors(tdist_module* m, const tdist_tensor* params, size_t n, tdist_pg* pg,
                                       const tdist_fsdp_options* o, tdist_fsdp** out);
tdist_status tdist_fsdp_pre_forward(tdist_fsdp* u);
tdist_status tdist_fsdp_post_forward(tdist_fsdp* u, const tdist_tensor* outputs, size_t n);
tdist_status tdist_fsdp_abort_forward(tdist_fsdp* u);
/* Mixed precision: a floating-point input converted to the unit's
 * param_dtype (a new tensor, the caller's to free). */
tdist_status tdist_fsdp_cast_input(tdist_fsdp* u, tdist_tensor input, tdist_tensor* out);
/* Over this unit's tree: the global gradient norm before clipping. */
tdist_status tdist_fsdp_clip_grad_norm(tdist_fsdp* u, double max_norm, double norm_type, double* total_norm);
/* FSDP2's controls over the unit's tree (recurse) or the unit alone. */
tdist_status tdist_fsdp_set_requires_gradient_sync(tdist_fsdp* u, int on, int recurse);
tdist_status tdist_fsdp_set_reshard_after_backward(tdist_fsdp* u, int on, int recurse);
tdist_status tdist_fsdp_reshard(tdist_fsdp* u);
/* Join over FSDP: what a joined rank runs per iteration of the others (a
 * training step on any batch of the right shape: forward, backward, the
 * optimizer's step). A failing step returns nonzero. */
tdist_status tdist_fsdp_set_join_step(tdist_fsdp* u, int (*step)(void* user), void* user);
tdist_status tdist_fsdp_free(tdist_fsdp* u);

/* ---- Join: uneven inputs (torch.distributed.algorithms.Join) ---------------
 * tdist_join_new(&ddp, 1, NULL, 0, 1, &j); train on this rank's batches;
 * tdist_join_join(j) shadows the others' remaining iterations; then free. */
tdist_status tdist_join_new(tdist_ddp* const* ddps, size_t n_ddp, tdist_fsdp* const* fsdps, size_t n_fsdp,
                            int divide_by_initial_world_size, tdist_join** out);
tdist_status tdist_join_join(tdist_join* j);
tdist_status tdist_join_free(tdist_join* j);

/* ---- state dicts: names -> tensors -----------------------------------------
 * Names are the binding's (no wrapper steps). A tdist_tensor_list holds
 * tensors tdist made: borrowed from the list until it is freed. */
tdist_status tdist_tensor_list_size(const tdist_tensor_list* l, size_t* n);
/* *name and *t are the list's, valid until tdist_tensor_list_free. */
tdist_status tdist_tensor_list_get(const tdist_tensor_list* l, size_t i, const char** name, tdist_tensor* t);
tdist_status tdist_tensor_list_free(tdist_tensor_list* l);
/* Whole parameters and buffers (FSDP: gathered, collective); rank0_only:
 * other ranks get an empty list. */
tdist_status tdist_full_state_dict(tdist_module* m, int rank0_only, tdist_tensor_list** out);
/* Copies the values into the module's tensors (each rank keeps its rows
 * under FSDP, any world size); strict: nothing missing, nothing extra. */
tdist_status tdist_load_full_state_dict(tdist_module* m, const char* const* names, const tdist_tensor* tensors,
                                        size_t n, int strict);
/* This rank's shards (everything else whole); loads back at the same
 * world size and layout. */
tdist_status tdist_sharded_state_dict(tdist_module* m, tdist_tensor_list** out);
tdist_status tdist_load_sharded_state_dict(tdist_module* m, const char* const* names, const tdist_tensor* tensors,
                                           size_t n, int strict);

/* ---- files ------------------------------------------------------------------
 * Sharded checkpoints of the model (format "tdist": torch_xla's per-rank
 * files, loading at any world size; "dcp": PyTorch's torch.distributed.
 * checkpoint folder). Collective over pg. The binding's optimizer state is
 * not tdist's to see: save it with the Checkpointer's extras. */
tdist_status tdist_save_sharded_checkpoint(tdist_module* m, tdist_pg* pg, const char* prefix, const char* format);
tdist_status tdist_load_sharded_checkpoint(tdist_module* m, tdist_pg* pg, const char* prefix, const char* format);
/* A safetensors file of named tensors (Hugging Face's format), not collective. */
tdist_status tdist_save_safetensors(const char* path, const char* const* names, const tdist_tensor* tensors,
                                    size_t n);
tdist_status tdist_load_safetensors(const char* path, tdist_tensor_list** out);

/* The Checkpointer (tdist/checkpointer.h): saves every every_steps steps
 * into dir (asynchronously by default), keeps the last keep_last, and
 * restores the latest complete one. extras: this rank's named tensors saved
 * with it (data position, the binding's optimizer state). Collective. */
tdist_status tdist_checkpointer_new(tdist_module* m, tdist_pg* pg, const char* dir, int64_t every_steps,
                                    int keep_last, int async, tdist_checkpointer** out);
/* *step: the restored step, or -1 when dir holds no checkpoint (then
 * *extras is NULL). extras may be NULL. */
tdist_status tdist_checkpointer_restore(tdist_checkpointer* c, int64_t* step, tdist_tensor_list** extras);
/* *saved: 1 when step was due and a save started. */
tdist_status tdist_checkpointer_maybe_save(tdist_checkpointer* c, int64_t step, const char* const* names,
                                           const tdist_tensor* extras, size_t n, int* saved);
tdist_status tdist_checkpointer_save(tdist_checkpointer* c, int64_t step, const char* const* names,
                                     const tdist_tensor* extras, size_t n);
tdist_status tdist_checkpointer_wait(tdist_checkpointer* c);
tdist_status tdist_checkpointer_free(tdist_checkpointer* c);

/* Writes this rank's flight recorder dump now (JSON, as tdist-trace
 * analyze reads it) to $TDIST_DUMP_DIR/rank-<R>.json; *path is the file
 * ("" when the recorder is off), valid until this thread's next tdist call. */
tdist_status tdist_dump_flight_recorder(const char** path);

/* ---- tensors for C programs ------------------------------------------------
 * For callers with no tensor library of their own (a C program; bindings
 * use theirs): CPU tensors and the few ops with autograd that train a
 * small model (Linear layers, relu/tanh, mean squared error, SGD), the
 * same LibTorch calls as torch::nn::Linear, torch::mse_loss and
 * torch::optim::SGD make, so their results match the C++ API's bit for bit.
 * Every tensor made here is the caller's to free with tdist_tensor_free. */
/* 1-d, numel elements of dtype. */
tdist_status tdist_tensor_from_data(const void* data, int64_t numel, int dtype, tdist_tensor* out);
tdist_status tdist_tensor_zeros(int64_t numel, int dtype, tdist_tensor* out);
/* shape[ndim] (ndim <= 8), the elements row-major from data; requires_grad
 * 1 for a parameter. */
tdist_status tdist_tensor_new(const void* data, const int64_t* shape, size_t ndim, int dtype, int requires_grad,
                              tdist_tensor* out);
tdist_status tdist_tensor_numel(tdist_tensor t, int64_t* out);
/* Copies the tensor's elements (contiguous, as its dtype) into data, which holds `bytes`. */
tdist_status tdist_tensor_copy_to(tdist_tensor t, void* data, size_t bytes);
/* y = x w^T + b (b may be NULL), as torch::nn::Linear. */
tdist_status tdist_tensor_linear(tdist_tensor x, tdist_tensor w, tdist_tensor b, tdist_tensor* out);
tdist_status tdist_tensor_relu(tdist_tensor x, tdist_tensor* out);
tdist_status tdist_tensor_tanh(tdist_tensor x, tdist_tensor* out);
/* The mean of (y - target)^2, y converted to target's dtype first. */
tdist_status tdist_tensor_mse_loss(tdist_tensor y, tdist_tensor target, tdist_tensor* out);
/* Backward from a scalar: gradients accumulate into the parameters' .grad. */
tdist_status tdist_tensor_backward(tdist_tensor loss);
/* p -= lr * p.grad for each parameter with a gradient, then every
 * gradient dropped: torch::optim::SGD(lr).step() and zero_grad(). */
tdist_status tdist_tensor_sgd_step(const tdist_tensor* params, size_t n, double lr);
tdist_status tdist_tensor_free(tdist_tensor t);

#ifdef __cplusplus
}
#endif

#endif /* TDIST_C_TDIST_H */
