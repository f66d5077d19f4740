/* Training through the C ABI from C99, as a binding would (its own ops:
 * tests/c/binding_ops.h), under tdist-run at worlds 2 and 3: DDP (plain,
 * fp16 hook with no_sync, Join on uneven inputs) and FSDP (FULL_SHARD;
 * SHARD_GRAD_OP with bfloat16 parameters), each compared bit for bit with
 * tdist's C++ API training the same model (tt_reference); then state
 * dicts, a sharded checkpoint, a safetensors file, the Checkpointer and the
 * flight recorder through the C ABI, and misuse of the new calls. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "binding_ops.h"
#include "check.h"
#include "tdist/c/tdist.h"

static const int kSteps = 6;
static const double kLr = 0.05;


/* Step s's forward and backward of the model over p (the binding's
 * tensors); x cast for mixed precision when root is given. */
static void forward_backward(tt_tensor* p, int s, tdist_ddp* ddp, tdist_fsdp** units) {
  tt_tensor x = NULL, target = NULL, xc = NULL, h = NULL, a = NULL, y = NULL, loss = NULL;
  check(tt_step_batch(rank, s, &x, &target) == 0, "tt_step_batch");
  if (ddp) OK(tdist_ddp_pre_forward(ddp));
  if (units) {
    OK(tdist_fsdp_pre_forward(units[2]));
    OK(tdist_fsdp_cast_input(units[2], x, &xc));
    OK(tdist_fsdp_pre_forward(units[0]));
  }
  NN(h = tt_linear(xc ? xc : x, p[0], p[1]));
  if (units) OK(tdist_fsdp_post_forward(units[0], &h, 1));
  NN(a = tt_tanh(h));
  if (units) OK(tdist_fsdp_pre_forward(units[1]));
  NN(y = tt_linear(a, p[2], p[3]));
  if (units) {
    OK(tdist_fsdp_post_forward(units[1], &y, 1));
    OK(tdist_fsdp_post_forward(units[2], &y, 1));
  }
  if (ddp) OK(tdist_ddp_post_forward(ddp, &y, 1));
  NN(loss = tt_mse(y, target));
  check(tt_backward(loss) == 0, "tt_backward");
  tt_free(loss);
  tt_free(y);
  tt_free(a);
  tt_free(h);
  if (xc) OK(tdist_tensor_free(xc));
  tt_free(x);
  tt_free(target);
}

static void compare(const char* mode, tt_tensor* mine) {
  tt_tensor ref[TT_NPARAMS];
  int i;
  char what[128];
  check(tt_reference(mode, kSteps, kLr, ref) == 0, "tt_reference");
  for (i = 0; i < TT_NPARAMS; ++i) {
    snprintf(what, sizeof what, "%s: %s equals the C++ API's bit for bit", mode, tt_names[i]);
    check(tt_equal(mine[i], ref[i]), what);
    tt_free(ref[i]);
  }
}

static void train_ddp(const char* mode) {
  tt_tensor p[TT_NPARAMS];
  tdist_module* m = NULL;
  tdist_ddp* ddp = NULL;
  tdist_join* join = NULL;
  const int nosync = strcmp(mode, "ddp-fp16-nosync") == 0, uneven = strcmp(mode, "ddp-join") == 0;
  tdist_ddp_options o;
  int s, i;
  check(tt_init_params(rank, p) == 0, "tt_init_params");
  OK(tdist_module_new(tt_names, p, TT_NPARAMS, &m));
  tdist_ddp_options_init(&o);
  if (strcmp(mode, "ddp-unused-view") == 0) {
    o.find_unused_parameters = 1;
    o.gradient_as_bucket_view = 1;
  }
  OK(tdist_ddp_new(m, NULL, &o, &ddp));
  if (nosync) OK(tdist_ddp_register_comm_hook(ddp, "fp16", NULL));
  if (strcmp(mode, "ddp-powersgd") == 0) OK(tdist_ddp_register_comm_hook(ddp, "powersgd:1:2", NULL));
  if (uneven) OK(tdist_join_new(&ddp, 1, NULL, 0, 1, &join));
  for (s = 0; s < kSteps + (uneven ? rank : 0); ++s) {
    const int accumulate = nosync && s % 2 == 0;
    if (accumulate) OK(tdist_ddp_set_require_sync(ddp, 0));
    forward_backward(p, s, ddp, NULL);
    if (accumulate) {
      OK(tdist_ddp_set_require_sync(ddp, 1));
    } else {
      check(tt_sgd_step(p, TT_NPARAMS, kLr) == 0, "tt_sgd_step");
    }
  }
  if (join) {
    OK(tdist_join_join(join));
    OK(tdist_join_free(join));
  }
  compare(mode, p);
  OK(tdist_ddp_free(ddp));
  OK(tdist_module_free(m));
  for (i = 0; i < TT_NPARAMS; ++i) tt_free(p[i]);
}

/* The whole parameters as a list, in tt_names' order (borrowed from l). */
static void full_params(tdist_module* m, tdist_tensor_list** l, tt_tensor* out) {
  size_t n = 0, k;
  int i;
  const char* name = NULL;
  tdist_tensor t = NULL;
  OK(tdist_full_state_dict(m, 0, l));
  OK(tdist_tensor_list_size(*l, &n));
  check(n == TT_NPARAMS, "the full state dict has the model's 4 tensors");
  for (i = 0; i < TT_NPARAMS; ++i) {
    out[i] = NULL;
    for (k = 0; k < n; ++k) {
      OK(tdist_tensor_list_get(*l, k, &name, &t));
      if (strcmp(name, tt_names[i]) == 0) out[i] = t;
    }
    check(out[i] != NULL, "the full state dict names every parameter");
  }
}

static void files(tdist_pg* pg, tdist_module* m, const char* mode);

/* What a joined rank runs per iteration of the others: a step on step 0's batch. */
struct JoinStep {
  tt_tensor* p;
  tdist_fsdp** units;
};
static int join_step(void* user) {
  struct JoinStep* js = (struct JoinStep*)user;
  forward_backward(js->p, 0, NULL, js->units);
  return tt_sgd_step(js->p, TT_NPARAMS, kLr);
}

static void train_fsdp(tdist_pg* pg, const char* mode) {
  tt_tensor p[TT_NPARAMS], whole[TT_NPARAMS];
  tdist_module* m = NULL;
  tdist_fsdp* units[3] = {NULL, NULL, NULL};
  tdist_fsdp_options o;
  tdist_tensor_list* full = NULL;
  int s, i;
  check(tt_init_params(rank, p) == 0, "tt_init_params");
  OK(tdist_module_new(tt_names, p, TT_NPARAMS, &m));
  tdist_fsdp_options_init(&o);
  if (strcmp(mode, "fsdp-zero2-bf16") == 0) {
    o.sharding_strategy = TDIST_SHARD_GRAD_OP;
    o.param_dtype = TDIST_BFLOAT16;
  }
  if (strcmp(mode, "fsdp-hybrid") == 0) {
    o.sharding_strategy = TDIST_HYBRID_SHARD;
    o.hybrid_shard_size = 1;
  }
  if (strcmp(mode, "fsdp-tensors") == 0) { /* each unit named by its parameters */
    tdist_tensor stray = NULL;
    tdist_tensor mixed[2];
    mixed[0] = p[0];
    mixed[1] = p[2];
    IS(tdist_fully_shard_tensors(m, mixed, 2, NULL, &o, &units[0]), TDIST_ERR_USAGE); /* no one submodule's */
    NN(stray = tt_param(2, 0, 7));
    IS(tdist_fully_shard_tensors(m, &stray, 1, NULL, &o, &units[0]), TDIST_ERR_USAGE); /* not the module's */
    tt_free(stray);
    OK(tdist_fully_shard_tensors(m, &p[0], 2, NULL, &o, &units[0]));
    OK(tdist_fully_shard_tensors(m, &p[2], 2, NULL, &o, &units[1]));
    OK(tdist_fully_shard_tensors(m, NULL, 0, NULL, &o, &units[2]));
  } else {
    OK(tdist_fully_shard(m, "fc1", NULL, &o, &units[0]));
    OK(tdist_fully_shard(m, "fc2", NULL, &o, &units[1]));
    OK(tdist_fully_shard(m, "", NULL, &o, &units[2]));
  }
  if (strcmp(mode, "fsdp-join") == 0) { /* rank r has kSteps + r batches */
    struct JoinStep js;
    tdist_join* join = NULL;
    js.p = p;
    js.units = units;
    OK(tdist_fsdp_set_join_step(units[2], join_step, &js));
    OK(tdist_join_new(NULL, 0, &units[2], 1, 1, &join));
    for (s = 0; s < kSteps + rank; ++s) {
      forward_backward(p, s, NULL, units);
      check(tt_sgd_step(p, TT_NPARAMS, kLr) == 0, "tt_sgd_step");
    }
    OK(tdist_join_join(join));
    OK(tdist_join_free(join));
  } else {
    for (s = 0; s < kSteps; ++s) {
      forward_backward(p, s, NULL, units);
      check(tt_sgd_step(p, TT_NPARAMS, kLr) == 0, "tt_sgd_step");
    }
  }
  full_params(m, &full, whole);
  compare(mode, whole);
  OK(tdist_tensor_list_free(full));
  if (strcmp(mode, "fsdp") == 0) files(pg, m, mode);
  for (i = 0; i < 3; ++i) OK(tdist_fsdp_free(units[i]));
  OK(tdist_module_free(m));
  for (i = 0; i < TT_NPARAMS; ++i) tt_free(p[i]);
}

/* A directory every rank names alike: rank 0's pid, broadcast. */
static void shared_dir(tdist_pg* pg, char* dir, size_t n) {
  int64_t pid = (int64_t)getpid();
  tdist_tensor t = NULL;
  const char* tmp = getenv("TMPDIR");
  OK(tdist_tensor_from_data(&pid, 1, TDIST_INT64, &t));
  OK(tdist_broadcast(pg, t, 0, 60000));
  OK(tdist_tensor_copy_to(t, &pid, sizeof pid));
  OK(tdist_tensor_free(t));
  snprintf(dir, n, "%s/tdist_c_train_%lld", tmp ? tmp : "/tmp", (long long)pid);
  if (rank == 0) check(mkdir(dir, 0700) == 0, "mkdir of the test's directory");
  OK(tdist_barrier(pg, 60000));
}

/* Scales every parameter of m by 0 (the values a load must bring back). */
static void zero_model(tdist_module* m) {
  static const int64_t shapes[TT_NPARAMS][2] = {{16, 8}, {16, 0}, {4, 16}, {4, 0}};
  static const float none[128] = {0};
  tdist_tensor_list* l = NULL;
  tdist_tensor zeros[TT_NPARAMS];
  const char* names[TT_NPARAMS];
  tt_tensor cur[TT_NPARAMS];
  float first = 1;
  int i;
  for (i = 0; i < TT_NPARAMS; ++i) {
    zeros[i] = tt_batch(1, 1, 0);
    names[i] = tt_names[i];
  }
  /* wrong shapes are refused */
  IS(tdist_load_full_state_dict(m, names, zeros, TT_NPARAMS, 1), TDIST_ERR_CHECKPOINT);
  for (i = 0; i < TT_NPARAMS; ++i) tt_free(zeros[i]);
  /* the right ones load: every parameter is zero afterwards */
  for (i = 0; i < TT_NPARAMS; ++i) {
    OK(tdist_tensor_new(none, shapes[i], shapes[i][1] ? 2 : 1, TDIST_FLOAT32, 0, &zeros[i]));
  }
  OK(tdist_load_full_state_dict(m, names, zeros, TT_NPARAMS, 1));
  for (i = 0; i < TT_NPARAMS; ++i) OK(tdist_tensor_free(zeros[i]));
  full_params(m, &l, cur);
  {
    float w[128];
    OK(tdist_tensor_copy_to(cur[0], w, sizeof w));
    first = w[0] + w[127];
  }
  check(first == 0, "the model is zero before the load");
  OK(tdist_tensor_list_free(l));
}

static void expect_trained(tdist_module* m, const char* what) {
  tdist_tensor_list* l = NULL;
  tt_tensor cur[TT_NPARAMS], ref[TT_NPARAMS];
  int i;
  full_params(m, &l, cur);
  check(tt_reference("fsdp", kSteps, kLr, ref) == 0, "tt_reference");
  for (i = 0; i < TT_NPARAMS; ++i) {
    check(tt_equal(cur[i], ref[i]), what);
    tt_free(ref[i]);
  }
  OK(tdist_tensor_list_free(l));
}

/* The Checkpointer (a save with extras, restored by a new one), then the
 * flight recorder's dump; removes the test's directory. */
static void checkpointer_and_recorder(tdist_pg* pg, tdist_module* m, const char* dir) {
  char path[600];
  tdist_tensor_list* extras = NULL;
  tdist_checkpointer* ck = NULL;
  const char* json = NULL;
  const char* ename = "samples_seen";
  const char* name = NULL;
  int64_t step = 0, seen = 0;
  tdist_tensor pos = NULL, got = NULL;
  int i;
  /* the Checkpointer: a save with extras, restored by a new one */
  snprintf(path, sizeof path, "%s/ckpt", dir);
  OK(tdist_checkpointer_new(m, pg, path, 2, 2, 1, &ck));
  OK(tdist_checkpointer_restore(ck, &step, &extras));
  check(step == -1 && extras == NULL, "an empty dir restores nothing");
  seen = 4242 + rank;
  OK(tdist_tensor_from_data(&seen, 1, TDIST_INT64, &pos));
  OK(tdist_checkpointer_maybe_save(ck, 4, &ename, &pos, 1, &i));
  check(i == 1, "step 4 is due every 2 steps");
  OK(tdist_checkpointer_wait(ck));
  OK(tdist_checkpointer_free(ck));
  zero_model(m);
  OK(tdist_checkpointer_new(m, pg, path, 2, 2, 1, &ck));
  OK(tdist_checkpointer_restore(ck, &step, &extras));
  check(step == 4, "the Checkpointer restores step 4");
  OK(tdist_tensor_list_get(extras, 0, &name, &got));
  check(strcmp(name, ename) == 0, "the extra's name");
  OK(tdist_tensor_copy_to(got, &seen, sizeof seen));
  check(seen == 4242 + rank, "this rank's extra comes back");
  expect_trained(m, "the Checkpointer restores the model bit for bit");
  OK(tdist_tensor_list_free(extras));
  OK(tdist_checkpointer_free(ck));
  OK(tdist_tensor_free(pos));

  /* the flight recorder */
  OK(tdist_dump_flight_recorder(&json));
  check(json != NULL && json[0] != '\0', "the flight recorder wrote a dump");
  {
    static char text[1 << 20];
    FILE* f = fopen(json, "r");
    size_t got_bytes = 0;
    check(f != NULL, "the dump can be opened");
    got_bytes = fread(text, 1, sizeof text - 1, f);
    text[got_bytes] = '\0';
    fclose(f);
    check(text[0] == '{' && strstr(text, "all_gather_into_tensor") != NULL,
          "the dump is JSON naming FSDP's gathers");
    check(remove(json) == 0, "removing the dump");
  }
  OK(tdist_barrier(pg, 60000));
  if (rank == 0) {
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    check(system(cmd) == 0, "removing the test's directory");
  }
}

static void files(tdist_pg* pg, tdist_module* m, const char* mode) {
  char dir[512], path[600];
  tdist_tensor_list *sharded = NULL, *full = NULL, *loaded = NULL;
  size_t n = 0, k;
  const char** names = NULL;
  tdist_tensor* ts = NULL;
  tdist_tensor got = NULL;
  const char* name = NULL;
  tt_tensor whole[TT_NPARAMS];
  int i;
  (void)mode;
  shared_dir(pg, dir, sizeof dir);

  /* sharded state dict: this rank's rows, loaded back */
  OK(tdist_sharded_state_dict(m, &sharded));
  OK(tdist_tensor_list_size(sharded, &n));
  check(n == TT_NPARAMS, "the sharded state dict has 4 entries");
  names = calloc(n, sizeof *names);
  ts = calloc(n, sizeof *ts);
  for (k = 0; k < n; ++k) OK(tdist_tensor_list_get(sharded, k, &names[k], &ts[k]));
  OK(tdist_load_sharded_state_dict(m, names, ts, n, 1));
  IS(tdist_tensor_list_get(sharded, n, &names[0], &ts[0]), TDIST_ERR_USAGE);
  free(names);
  free(ts);
  OK(tdist_tensor_list_free(sharded));

  /* a sharded checkpoint, then refused loads that change nothing, then its load */
  snprintf(path, sizeof path, "%s/model", dir);
  OK(tdist_save_sharded_checkpoint(m, pg, path, "tdist"));
  zero_model(m);
  OK(tdist_load_sharded_checkpoint(m, pg, path, "tdist"));
  expect_trained(m, "a sharded checkpoint loads back bit for bit");
  /* the same as PyTorch's DCP folder */
  snprintf(path, sizeof path, "%s/dcp", dir);
  OK(tdist_save_sharded_checkpoint(m, pg, path, "dcp"));
  zero_model(m);
  OK(tdist_load_sharded_checkpoint(m, pg, path, "dcp"));
  expect_trained(m, "a DCP checkpoint loads back bit for bit");
  IS(tdist_save_sharded_checkpoint(m, pg, path, "pickle"), TDIST_ERR_USAGE);
  snprintf(path, sizeof path, "%s/missing", dir);
  IS(tdist_load_sharded_checkpoint(m, pg, path, "tdist"), TDIST_ERR_CHECKPOINT);

  /* safetensors: the full state dict, written by each rank to its own file */
  full_params(m, &full, whole);
  snprintf(path, sizeof path, "%s/model-%d.safetensors", dir, rank);
  OK(tdist_save_safetensors(path, tt_names, whole, TT_NPARAMS));
  OK(tdist_load_safetensors(path, &loaded));
  OK(tdist_tensor_list_size(loaded, &n));
  check(n == TT_NPARAMS, "the safetensors file holds 4 tensors");
  for (k = 0; k < n; ++k) {
    OK(tdist_tensor_list_get(loaded, k, &name, &got));
    for (i = 0; i < TT_NPARAMS; ++i) {
      if (strcmp(name, tt_names[i]) == 0) check(tt_equal(got, whole[i]), "safetensors round trip");
    }
  }
  OK(tdist_load_full_state_dict(m, tt_names, whole, TT_NPARAMS, 1));
  OK(tdist_tensor_list_free(loaded));
  OK(tdist_tensor_list_free(full));
  snprintf(path, sizeof path, "%s/nothing.safetensors", dir);
  IS(tdist_load_safetensors(path, &loaded), TDIST_ERR_CHECKPOINT);

  checkpointer_and_recorder(pg, m, dir);

}

/* Async ops from many short-lived threads, one after another: the work
 * slots a thread frees outlive it (a thread's first op once took a fresh
 * slab, and after 16384 threads every op failed). */
static tdist_pg* churn_pg = NULL;
static tdist_tensor churn_t = NULL;
static void* churn_one(void* failed) {
  tdist_work* w = NULL;
  if (tdist_all_reduce_async(churn_pg, churn_t, TDIST_SUM, 60000, &w) != TDIST_OK ||
      tdist_work_wait(w, 60000) != TDIST_OK || tdist_work_free(w) != TDIST_OK) {
    fprintf(stderr, "rank %d: churn: %s\n", rank, tdist_last_error());
    *(int*)failed = 1;
  }
  return NULL;
}
static void thread_churn(tdist_pg* pg) {
  const float zero = 0;
  int i, failed = 0;
  churn_pg = pg;
  OK(tdist_tensor_from_data(&zero, 1, TDIST_FLOAT32, &churn_t));
  for (i = 0; i < 17000 && !failed; ++i) {
    pthread_t t;
    check(pthread_create(&t, NULL, churn_one, &failed) == 0, "pthread_create");
    check(pthread_join(t, NULL) == 0, "pthread_join");
  }
  check(!failed, "17000 threads, one async op each");
  OK(tdist_tensor_free(churn_t));
}

/* Found by an adversarial review: each once crashed, hung or went wrong. */
static void more_misuse(void) {
  tt_tensor p[TT_NPARAMS], x = NULL, target = NULL, h = NULL;
  tdist_module* m = NULL;
  tdist_fsdp *u = NULL, *root = NULL;
  tdist_fsdp_options o;
  const char* shadow[1] = {"fc1.weight"};
  const char* one_name[1] = {"w"};
  int i;
  check(tt_init_params(rank, p) == 0, "tt_init_params");
  /* a buffer may not take a parameter's name */
  OK(tdist_module_new(tt_names, p, TT_NPARAMS, &m));
  IS(tdist_module_add_buffers(m, shadow, &p[1], 1), TDIST_ERR_USAGE);
  check(strstr(tdist_last_error(), "fc1.weight") != NULL, "the error names the tensor");
  OK(tdist_module_free(m));
  /* a parameter must be a leaf */
  check(tt_step_batch(rank, 0, &x, &target) == 0, "tt_step_batch");
  NN(h = tt_linear(x, p[0], p[1]));
  IS(tdist_module_new(one_name, &h, 1, &m), TDIST_ERR_USAGE);
  check(strstr(tdist_last_error(), "leaf") != NULL, "the error says leaf");
  tt_free(h);
  /* an aborted forward leaves the unit ready for the next one */
  OK(tdist_module_new(tt_names, p, TT_NPARAMS, &m));
  tdist_fsdp_options_init(&o);
  OK(tdist_fully_shard(m, "fc1", NULL, &o, &u));
  OK(tdist_fully_shard(m, "", NULL, &o, &root));
  OK(tdist_fsdp_pre_forward(root));
  OK(tdist_fsdp_pre_forward(u));
  OK(tdist_fsdp_abort_forward(u));
  OK(tdist_fsdp_abort_forward(root));
  OK(tdist_fsdp_pre_forward(root));
  OK(tdist_fsdp_pre_forward(u));
  NN(h = tt_linear(x, p[0], p[1]));
  OK(tdist_fsdp_post_forward(u, &h, 1));
  OK(tdist_fsdp_post_forward(root, &h, 1));
  tt_free(h);
  OK(tdist_fsdp_free(u));
  OK(tdist_fsdp_free(root));
  OK(tdist_module_free(m));
  for (i = 0; i < TT_NPARAMS; ++i) tt_free(p[i]);
  /* ranks whose units differ: refused on every rank, and the group goes on */
  check(tt_init_params(rank, p) == 0, "tt_init_params");
  OK(tdist_module_new(tt_names, p, TT_NPARAMS, &m));
  tdist_fsdp_options_init(&o);
  if (rank == 1) o.param_dtype = TDIST_BFLOAT16;
  IS(tdist_fully_shard(m, "fc1", NULL, &o, &u), TDIST_ERR_USAGE);
  check(strstr(tdist_last_error(), "differs from rank 0") != NULL, "the error names the rank that differs");
  OK(tdist_module_free(m));
  for (i = 0; i < TT_NPARAMS; ++i) tt_free(p[i]);
  tt_free(x);
  tt_free(target);
}

static void misuse(tdist_pg* pg) {
  tt_tensor p[TT_NPARAMS];
  tdist_module* m = NULL;
  tdist_ddp* ddp = NULL;
  tdist_fsdp *u = NULL, *u2 = NULL;
  tdist_fsdp_options o;
  const char* dotted[2] = {"a..b", "a"};
  int i;
  (void)pg;
  check(tt_init_params(rank, p) == 0, "tt_init_params");
  IS(tdist_module_new(dotted, p, 1, &m), TDIST_ERR_USAGE);
  IS(tdist_module_new(tt_names, NULL, 2, &m), TDIST_ERR_USAGE);
  IS(tdist_ddp_new(NULL, NULL, NULL, &ddp), TDIST_ERR_USAGE);
  IS(tdist_ddp_pre_forward((tdist_ddp*)p[0]), TDIST_ERR_USAGE); /* a foreign pointer */
  OK(tdist_module_new(tt_names, p, TT_NPARAMS, &m));
  tdist_fsdp_options_init(&o);
  o.struct_size = 8;
  IS(tdist_fully_shard(m, "", NULL, &o, &u2), TDIST_ERR_USAGE);
  check(strstr(tdist_last_error(), "struct_size") != NULL, "the error names struct_size");
  tdist_fsdp_options_init(&o);
  IS(tdist_fully_shard(m, "fc3", NULL, &o, &u2), TDIST_ERR_USAGE);
  check(strstr(tdist_last_error(), "fc3") != NULL, "the error names the path");
  o.sharding_strategy = 17;
  IS(tdist_fully_shard(m, "fc1", NULL, &o, &u2), TDIST_ERR_USAGE);
  tdist_fsdp_options_init(&o);
  OK(tdist_fully_shard(m, "fc1", NULL, &o, &u));
  IS(tdist_fully_shard(m, "fc1", NULL, &o, &u2), TDIST_ERR_USAGE); /* twice */
  IS(tdist_fsdp_post_forward(u, NULL, 0), TDIST_ERR_USAGE);        /* no pre_forward */
  IS(tdist_ddp_new(m, NULL, NULL, &ddp), TDIST_ERR_USAGE);         /* a module with FSDP units */
  OK(tdist_fsdp_free(u));
  IS(tdist_fsdp_free(u), TDIST_ERR_USAGE);
  IS(tdist_fsdp_pre_forward(u), TDIST_ERR_USAGE);
  OK(tdist_module_free(m));
  IS(tdist_module_free(m), TDIST_ERR_USAGE);
  /* fc1's tensors are this rank's shards now (a freed unit does not
   * unshard them): fresh ones for DDP */
  for (i = 0; i < TT_NPARAMS; ++i) tt_free(p[i]);
  check(tt_init_params(rank, p) == 0, "tt_init_params");
  OK(tdist_module_new(tt_names, p, TT_NPARAMS, &m));
  OK(tdist_ddp_new(m, NULL, NULL, &ddp));
  IS(tdist_ddp_register_comm_hook(ddp, "zip", NULL), TDIST_ERR_USAGE);
  IS(tdist_ddp_register_comm_hook(ddp, "powersgd:0:5", NULL), TDIST_ERR_USAGE);
  {
    tdist_ddp* again = NULL;
    IS(tdist_ddp_new(m, NULL, NULL, &again), TDIST_ERR_USAGE); /* wrapped already */
  }
  OK(tdist_ddp_free(ddp));
  OK(tdist_module_free(m));
  for (i = 0; i < TT_NPARAMS; ++i) tt_free(p[i]);
  more_misuse();
}

int main(void) {
  tdist_pg* pg = NULL;
  OK(tdist_check_abi(TDIST_C_ABI_VERSION, tdist_torch_version()));
  OK(tdist_init_process_group("auto", 60000, &pg));
  OK(tdist_pg_rank(pg, &rank));
  train_ddp("ddp");
  train_ddp("ddp-fp16-nosync");
  train_ddp("ddp-join");
  train_ddp("ddp-powersgd");
  train_ddp("ddp-unused-view");
  train_fsdp(pg, "fsdp");
  train_fsdp(pg, "fsdp-zero2-bf16");
  train_fsdp(pg, "fsdp-join");
  train_fsdp(pg, "fsdp-hybrid");
  train_fsdp(pg, "fsdp-tensors");
  misuse(pg);
  {
    int size = 0;
    OK(tdist_pg_size(pg, &size));
    if (size == 2) thread_churn(pg); /* once is enough: the slots are per process */
  }
  OK(tdist_pg_free(pg));
  printf("rank %d: c_train ok\n", rank);
  return 0;
}
