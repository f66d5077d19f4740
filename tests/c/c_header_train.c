/* A C99 program written from include/tdist/c/tdist.h alone (no other
 * library): a two-layer model, Linear(6, 8), relu, Linear(8, 3), trained
 * with SGD through DDP and through FSDP (a unit per layer and the root),
 * 5 steps each, with the header's own tensor ops. Each rank writes the
 * final whole weights (fc1.weight, fc1.bias, fc2.weight, fc2.bias as raw
 * float32) to DIR/c-ddp-rank-R.bin and DIR/c-fsdp-rank-R.bin;
 * c_header_reference trains the same with tdist's C++ API and compares
 * them bit for bit. Usage: tdist-run --nproc-per-node N c_header_train DIR */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tdist/c/tdist.h"

#define NP 4
#define STEPS 5
static const char* const names[NP] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
static const int64_t shapes[NP][2] = {{8, 6}, {8, 0}, {3, 8}, {3, 0}};
static int rank = -1;

static void ok(tdist_status s, const char* what) {
  if (s != TDIST_OK) {
    fprintf(stderr, "rank %d: FAILED: %s: %s\n", rank, what, tdist_last_error());
    exit(1);
  }
}

static int64_t numel_of(int i) { return shapes[i][0] * (shapes[i][1] ? shapes[i][1] : 1); }

/* Parameters from a formula, different on every rank (DDP and FSDP make them rank 0's). */
static void init_params(tdist_tensor* p) {
  float v[64];
  int i;
  int64_t j;
  for (i = 0; i < NP; ++i) {
    for (j = 0; j < numel_of(i); ++j) v[j] = (float)(0.3 * sin(0.7 * (double)j + 1.3 * i + rank));
    ok(tdist_tensor_new(v, shapes[i], shapes[i][1] ? 2 : 1, TDIST_FLOAT32, 1, &p[i]), "tdist_tensor_new");
  }
}

static void batch(int step, tdist_tensor* x, tdist_tensor* y) {
  float xv[24], yv[12];
  const int64_t xs[2] = {4, 6}, ys[2] = {4, 3};
  int k;
  for (k = 0; k < 24; ++k) xv[k] = (float)cos(0.1 * k + step + 0.5 * rank);
  for (k = 0; k < 12; ++k) yv[k] = (float)sin(0.2 * k - step + rank);
  ok(tdist_tensor_new(xv, xs, 2, TDIST_FLOAT32, 0, x), "batch x");
  ok(tdist_tensor_new(yv, ys, 2, TDIST_FLOAT32, 0, y), "batch y");
}

static void save(const char* dir, const char* kind, tdist_tensor* w) {
  char path[1024];
  float v[64];
  int i;
  FILE* f;
  snprintf(path, sizeof path, "%s/c-%s-rank-%d.bin", dir, kind, rank);
  f = fopen(path, "wb");
  if (!f) {
    fprintf(stderr, "rank %d: cannot write %s\n", rank, path);
    exit(1);
  }
  for (i = 0; i < NP; ++i) {
    ok(tdist_tensor_copy_to(w[i], v, (size_t)numel_of(i) * sizeof(float)), "tdist_tensor_copy_to");
    fwrite(v, sizeof(float), (size_t)numel_of(i), f);
  }
  fclose(f);
}

/* One step: forward (between the wrappers' calls), backward, SGD. */
static void step(tdist_tensor* p, int s, tdist_ddp* ddp, tdist_fsdp** unit) {
  tdist_tensor x, y, h, a, out, loss;
  batch(s, &x, &y);
  if (ddp) ok(tdist_ddp_pre_forward(ddp), "tdist_ddp_pre_forward");
  if (unit) ok(tdist_fsdp_pre_forward(unit[2]), "root pre");
  if (unit) ok(tdist_fsdp_pre_forward(unit[0]), "fc1 pre");
  ok(tdist_tensor_linear(x, p[0], p[1], &h), "fc1");
  if (unit) ok(tdist_fsdp_post_forward(unit[0], &h, 1), "fc1 post");
  ok(tdist_tensor_relu(h, &a), "relu");
  if (unit) ok(tdist_fsdp_pre_forward(unit[1]), "fc2 pre");
  ok(tdist_tensor_linear(a, p[2], p[3], &out), "fc2");
  if (unit) ok(tdist_fsdp_post_forward(unit[1], &out, 1), "fc2 post");
  if (unit) ok(tdist_fsdp_post_forward(unit[2], &out, 1), "root post");
  if (ddp) ok(tdist_ddp_post_forward(ddp, &out, 1), "tdist_ddp_post_forward");
  ok(tdist_tensor_mse_loss(out, y, &loss), "mse");
  ok(tdist_tensor_backward(loss), "backward");
  ok(tdist_tensor_sgd_step(p, NP, 0.1), "sgd");
  tdist_tensor_free(loss);
  tdist_tensor_free(out);
  tdist_tensor_free(a);
  tdist_tensor_free(h);
  tdist_tensor_free(x);
  tdist_tensor_free(y);
}

int main(int argc, char** argv) {
  tdist_pg* pg;
  tdist_module* m;
  tdist_ddp* ddp;
  tdist_fsdp* unit[3];
  tdist_fsdp_options o;
  tdist_tensor p[NP], whole[NP];
  tdist_tensor_list* full;
  const char* name;
  tdist_tensor t;
  size_t n, k;
  int i, s;
  if (argc != 2) {
    fprintf(stderr, "usage: c_header_train DIR\n");
    return 2;
  }
  ok(tdist_check_abi(TDIST_C_ABI_VERSION, tdist_torch_version()), "tdist_check_abi");
  ok(tdist_init_process_group("auto", 60000, &pg), "tdist_init_process_group");
  ok(tdist_pg_rank(pg, &rank), "tdist_pg_rank");

  init_params(p);
  ok(tdist_module_new(names, p, NP, &m), "tdist_module_new");
  ok(tdist_ddp_new(m, NULL, NULL, &ddp), "tdist_ddp_new");
  for (s = 0; s < STEPS; ++s) step(p, s, ddp, NULL);
  save(argv[1], "ddp", p);
  ok(tdist_ddp_free(ddp), "tdist_ddp_free");
  ok(tdist_module_free(m), "tdist_module_free");
  for (i = 0; i < NP; ++i) tdist_tensor_free(p[i]);

  init_params(p);
  ok(tdist_module_new(names, p, NP, &m), "tdist_module_new");
  tdist_fsdp_options_init(&o);
  ok(tdist_fully_shard(m, "fc1", pg, &o, &unit[0]), "fully_shard fc1");
  ok(tdist_fully_shard(m, "fc2", pg, &o, &unit[1]), "fully_shard fc2");
  ok(tdist_fully_shard(m, "", pg, &o, &unit[2]), "fully_shard root");
  for (s = 0; s < STEPS; ++s) step(p, s, NULL, unit);
  ok(tdist_full_state_dict(m, 0, &full), "tdist_full_state_dict");
  ok(tdist_tensor_list_size(full, &n), "tdist_tensor_list_size");
  for (i = 0; i < NP; ++i) {
    whole[i] = NULL;
    for (k = 0; k < n; ++k) {
      ok(tdist_tensor_list_get(full, k, &name, &t), "tdist_tensor_list_get");
      if (strcmp(name, names[i]) == 0) whole[i] = t;
    }
    if (!whole[i]) {
      fprintf(stderr, "rank %d: %s is not in the full state dict\n", rank, names[i]);
      return 1;
    }
  }
  save(argv[1], "fsdp", whole);
  ok(tdist_tensor_list_free(full), "tdist_tensor_list_free");
  for (i = 0; i < 3; ++i) ok(tdist_fsdp_free(unit[i]), "tdist_fsdp_free");
  ok(tdist_module_free(m), "tdist_module_free");
  for (i = 0; i < NP; ++i) tdist_tensor_free(p[i]);
  ok(tdist_pg_free(pg), "tdist_pg_free");
  printf("rank %d: c_header_train wrote its weights\n", rank);
  return 0;
}
