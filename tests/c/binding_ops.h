/* What a LibTorch binding's own C layer gives its language (tch-rs's
 * torch_api.h, TorchSharp's LibTorchSharp): tensors as at::Tensor*, a few
 * ops with autograd, backward, an SGD step. The C and Rust tests train
 * with these and tdist's C ABI, as a binding would; tt_reference trains
 * the same model with tdist's C++ API, for comparison. Test support only:
 * not part of tdist. Every function returns NULL / nonzero on failure,
 * with the message on stderr. */
#ifndef TDIST_TESTS_C_BINDING_OPS_H
#define TDIST_TESTS_C_BINDING_OPS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef void* tt_tensor; /* an at::Tensor* */

/* A parameter (requires grad): seeded normal values times 0.3, shaped
 * [rows, cols] (cols 0: [rows]). */
tt_tensor tt_param(int64_t rows, int64_t cols, uint64_t seed);
/* A batch: seeded normal values, [rows, cols]. */
tt_tensor tt_batch(int64_t rows, int64_t cols, uint64_t seed);
tt_tensor tt_linear(tt_tensor x, tt_tensor w, tt_tensor b);
tt_tensor tt_tanh(tt_tensor x);
/* Mean squared error, y converted to target's dtype first. */
tt_tensor tt_mse(tt_tensor y, tt_tensor target);
int tt_backward(tt_tensor loss);
/* p.add_(p.grad, -lr) for each, as torch::optim::SGD, then the grads set to none. */
int tt_sgd_step(const tt_tensor* params, size_t n, double lr);
/* 1 when both have the same shape, dtype and bits. */
int tt_equal(tt_tensor a, tt_tensor b);
void tt_free(tt_tensor t);

/* The test's model: fc1 = Linear(8, 16), tanh, fc2 = Linear(16, 4); its
 * four parameters fc1.weight, fc1.bias, fc2.weight, fc2.bias, seeded by
 * rank (DDP's and FSDP's broadcast make them rank 0's). */
#define TT_NPARAMS 4
extern const char* const tt_names[TT_NPARAMS];
int tt_init_params(int rank, tt_tensor out[TT_NPARAMS]);
/* Step s's batch on rank r (rows 4): x [4, 8], target [4, 4]. */
int tt_step_batch(int rank, int step, tt_tensor* x, tt_tensor* target);

/* Trains the model with tdist's C++ API on the default group, as the C
 * tests do through the C ABI, and returns its whole parameters (the caller
 * frees them). mode: "ddp" (steps SGD steps), "ddp-fp16-nosync" (fp16
 * comm hook; odd steps under no_sync), "ddp-join" (rank r has steps + r
 * batches, in a Join), "ddp-powersgd" (PowerSGD rank 1 from step 2),
 * "ddp-unused-view" (find_unused_parameters, gradient_as_bucket_view),
 * "fsdp" (a unit per layer and the root, FULL_SHARD; "fsdp-tensors": the same), "fsdp-zero2-bf16"
 * (SHARD_GRAD_OP, param_dtype bfloat16), "fsdp-hybrid" (HYBRID_SHARD, shard
 * groups of one rank), "fsdp-join" (rank r has steps + r
 * batches, in a Join; a joined rank's step is on step 0's batch). */
int tt_reference(const char* mode, int steps, double lr, tt_tensor out[TT_NPARAMS]);

#ifdef __cplusplus
}
#endif

#endif
