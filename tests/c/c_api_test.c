/* The C ABI from C99 (include/tdist/c/tdist.h), run by tdist-run at world
 * 2 or 3: collectives sync and async, a subgroup, and misuse that must
 * return errors (null, freed and foreign handles, bad arguments, a
 * mismatched collective, a timeout), never crash. Prints "c_api ok" from
 * every rank; any failure exits 1 naming the check and tdist's message. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "tdist/c/tdist.h"



/* all_reduce_coalesced, and what an adversarial review found: a stale
 * work handle, handles of another kind, INT64_MAX as a timeout, unequal
 * all_to_all_single splits, a second init. */
static void more_calls(tdist_pg* pg, tdist_tensor t, tdist_tensor one, int size) {
  tdist_work* work = NULL;
  tdist_pg* sub = NULL;
  int i = 0;
  /* all_reduce_coalesced: two tensors as one op, sync and async */
  {
    tdist_tensor pair[2] = {NULL, NULL};
    float a[2], b[3];
    int k;
    for (k = 0; k < 2; ++k) a[k] = (float)(rank + k);
    for (k = 0; k < 3; ++k) b[k] = (float)(10 * rank + k);
    OK(tdist_tensor_from_data(a, 2, TDIST_FLOAT32, &pair[0]));
    OK(tdist_tensor_from_data(b, 3, TDIST_FLOAT32, &pair[1]));
    OK(tdist_all_reduce_coalesced(pg, pair, 2, TDIST_SUM, 60000));
    OK(tdist_all_reduce_coalesced_async(pg, pair, 2, TDIST_SUM, 60000, &work));
    OK(tdist_work_wait(work, 60000));
    OK(tdist_work_free(work));
    OK(tdist_tensor_copy_to(pair[0], a, sizeof a));
    OK(tdist_tensor_copy_to(pair[1], b, sizeof b));
    /* twice summed: size * (sum of the ranks' values) */
    for (k = 0; k < 2; ++k) check(a[k] == (float)(size * (size * (size - 1) / 2 + size * k)), "coalesced a");
    for (k = 0; k < 3; ++k) check(b[k] == (float)(size * (10 * size * (size - 1) / 2 + size * k)), "coalesced b");
    IS(tdist_all_reduce_coalesced(pg, pair, 0, TDIST_SUM, 60000), TDIST_ERR_USAGE);
    OK(tdist_tensor_free(pair[0]));
    OK(tdist_tensor_free(pair[1]));
  }
  /* the coalesced gather and reduce-scatter: pairs of 1 and 2 elements per rank */
  {
    float in1 = (float)(rank + 1), in2[2] = {(float)rank, 1.0f}, g1[8], g2[16], r1[1], r2[2], src1[8], src2[16];
    tdist_tensor outs[2], ins[2];
    int k;
    OK(tdist_tensor_zeros(size, TDIST_FLOAT32, &outs[0]));
    OK(tdist_tensor_zeros(2 * size, TDIST_FLOAT32, &outs[1]));
    OK(tdist_tensor_from_data(&in1, 1, TDIST_FLOAT32, &ins[0]));
    OK(tdist_tensor_from_data(in2, 2, TDIST_FLOAT32, &ins[1]));
    OK(tdist_all_gather_into_tensor_coalesced_async(pg, outs, ins, 2, 60000, &work));
    OK(tdist_work_wait(work, 60000));
    OK(tdist_work_free(work));
    OK(tdist_tensor_copy_to(outs[0], g1, sizeof(float) * (size_t)size));
    OK(tdist_tensor_copy_to(outs[1], g2, sizeof(float) * 2 * (size_t)size));
    for (k = 0; k < size; ++k) {
      check(g1[k] == (float)(k + 1) && g2[2 * k] == (float)k && g2[2 * k + 1] == 1.0f, "coalesced all_gather");
    }
    /* reduce-scatter back: every rank gives the gathered tensors; rank r gets size x its own piece */
    for (k = 0; k < size; ++k) src1[k] = g1[k];
    for (k = 0; k < 2 * size; ++k) src2[k] = g2[k];
    OK(tdist_tensor_free(ins[0]));
    OK(tdist_tensor_free(ins[1]));
    OK(tdist_tensor_from_data(src1, size, TDIST_FLOAT32, &ins[0]));
    OK(tdist_tensor_from_data(src2, 2 * size, TDIST_FLOAT32, &ins[1]));
    OK(tdist_tensor_free(outs[0]));
    OK(tdist_tensor_free(outs[1]));
    OK(tdist_tensor_zeros(1, TDIST_FLOAT32, &outs[0]));
    OK(tdist_tensor_zeros(2, TDIST_FLOAT32, &outs[1]));
    OK(tdist_reduce_scatter_tensor_coalesced(pg, outs, ins, 2, TDIST_SUM, 60000));
    OK(tdist_tensor_copy_to(outs[0], r1, sizeof r1));
    OK(tdist_tensor_copy_to(outs[1], r2, sizeof r2));
    check(r1[0] == (float)(size * (rank + 1)) && r2[0] == (float)(size * rank) && r2[1] == (float)size,
          "coalesced reduce_scatter");
    for (k = 0; k < 2; ++k) {
      OK(tdist_tensor_free(outs[k]));
      OK(tdist_tensor_free(ins[k]));
    }
  }
  /* a freed work stays freed when its slot is reused: the second free of
     the first is refused and the second work is untouched */
  {
    tdist_work *first = NULL, *second = NULL;
    OK(tdist_all_reduce_async(pg, one, TDIST_SUM, 60000, &first));
    OK(tdist_work_wait(first, 60000));
    OK(tdist_work_free(first));
    OK(tdist_all_reduce_async(pg, one, TDIST_SUM, 60000, &second));
    IS(tdist_work_free(first), TDIST_ERR_USAGE);
    IS(tdist_work_wait(first, 1000), TDIST_ERR_USAGE);
    OK(tdist_work_wait(second, 60000));
    OK(tdist_work_free(second));
  }
  /* a live handle of another kind is refused, and nothing is harmed */
  IS(tdist_all_reduce((tdist_pg*)t, t, TDIST_SUM, 1000), TDIST_ERR_USAGE);
  IS(tdist_pg_rank((tdist_pg*)one, &i), TDIST_ERR_USAGE);
  IS(tdist_tensor_free((tdist_tensor)pg), TDIST_ERR_USAGE);
  check(strstr(tdist_last_error(), "kind") != NULL, "the error says the handle is of another kind");
  IS(tdist_pg_free((tdist_pg*)t), TDIST_ERR_USAGE);
  /* INT64_MAX is "no limit", not an overflowed deadline */
  OK(tdist_all_reduce(pg, one, TDIST_SUM, INT64_MAX));
  /* unequal all_to_all_single sizes: refused before any rank sends; the group goes on */
  IS(tdist_all_to_all_single(pg, one, t, 60000), TDIST_ERR_USAGE);
  OK(tdist_barrier(pg, 60000));
  /* a second world group in one process */
  IS(tdist_init_process_group("auto", 60000, &sub), TDIST_ERR_USAGE);
  check(strstr(tdist_last_error(), "initialised already") != NULL, "the error says a group exists");

}

/* Misuse: errors, never a crash. */
static void misuse(tdist_pg* pg, tdist_tensor t) {
  tdist_tensor none = NULL;
  float v[4] = {0, 0, 0, 0};
  IS(tdist_all_reduce(NULL, t, TDIST_SUM, 1000), TDIST_ERR_USAGE);
  IS(tdist_all_reduce(pg, NULL, TDIST_SUM, 1000), TDIST_ERR_USAGE);
  IS(tdist_all_reduce(pg, t, 99, 1000), TDIST_ERR_USAGE);
  IS(tdist_tensor_zeros(4, -1, &none), TDIST_ERR_USAGE);
  IS(tdist_all_reduce(pg, t, TDIST_SUM, -5), TDIST_ERR_USAGE);
  IS(tdist_all_reduce((tdist_pg*)v, t, TDIST_SUM, 1000), TDIST_ERR_USAGE); /* not a handle */
  IS(tdist_pg_rank(pg, NULL), TDIST_ERR_USAGE);
  IS(tdist_tensor_copy_to(t, v, 3), TDIST_ERR_USAGE);
  IS(tdist_tensor_free((tdist_tensor)v), TDIST_ERR_USAGE);
  IS(tdist_tensor_from_data(NULL, 4, TDIST_FLOAT32, &none), TDIST_ERR_USAGE);
  check(none == NULL, "a failed call leaves its output NULL");
  IS(tdist_all_gather_into_tensor(pg, t, t, 1000), TDIST_ERR_USAGE); /* output is not world x input */
  check(strstr(tdist_last_error(), "tdist_all_gather_into_tensor") != NULL, "the error names the call");
}

int main(int argc, char** argv) {
  const char* backend = argc > 1 ? argv[1] : "auto"; /* e.g. "mpi" under mpirun */
  tdist_pg* pg = NULL;
  tdist_pg* sub = NULL;
  tdist_work* work = NULL;
  tdist_tensor t = NULL, out = NULL, one = NULL;
  float v[4], gathered[12];
  int size = 0, i = 0, done = 0;
  int ranks[2] = {0, 1};

  OK(tdist_check_abi(TDIST_C_ABI_VERSION, tdist_torch_version()));
  IS(tdist_check_abi(TDIST_C_ABI_VERSION + 1, NULL), TDIST_ERR_USAGE);
  check(strstr(tdist_last_error(), "ABI") != NULL, "the ABI error says ABI");
  IS(tdist_check_abi(TDIST_C_ABI_VERSION, "0.1.0"), TDIST_ERR_USAGE);

  OK(tdist_init_process_group(backend, 60000, &pg));
  OK(tdist_pg_rank(pg, &rank));
  OK(tdist_pg_size(pg, &size));
  check(size >= 2, "world size at least 2");

  /* all_reduce, sync: sum of (rank + 1) * [1, 2, 3, 4] */
  for (i = 0; i < 4; ++i) v[i] = (float)((rank + 1) * (i + 1));
  OK(tdist_tensor_from_data(v, 4, TDIST_FLOAT32, &t));
  OK(tdist_all_reduce(pg, t, TDIST_SUM, 60000));
  OK(tdist_tensor_copy_to(t, v, sizeof v));
  for (i = 0; i < 4; ++i) check(v[i] == (float)(size * (size + 1) / 2 * (i + 1)), "all_reduce sums");

  /* async all_reduce (MAX) and broadcast */
  for (i = 0; i < 4; ++i) v[i] = (float)(rank * 10 + i);
  tdist_tensor_free(t);
  OK(tdist_tensor_from_data(v, 4, TDIST_FLOAT32, &t));
  OK(tdist_all_reduce_async(pg, t, TDIST_MAX, 60000, &work));
  OK(tdist_work_wait(work, 60000));
  OK(tdist_work_is_completed(work, &done));
  check(done == 1, "a waited work is completed");
  OK(tdist_work_free(work));
  IS(tdist_work_free(work), TDIST_ERR_USAGE); /* freed twice */
  IS(tdist_work_wait(work, 1000), TDIST_ERR_USAGE);  /* freed */
  IS(tdist_work_wait((tdist_work*)t, 1000), TDIST_ERR_USAGE);     /* foreign: a tensor */
  IS(tdist_work_is_completed((tdist_work*)pg, &done), TDIST_ERR_USAGE); /* foreign: a group */
  IS(tdist_work_free((tdist_work*)((char*)work + 1)), TDIST_ERR_USAGE); /* inside a slot */
  OK(tdist_tensor_copy_to(t, v, sizeof v));
  for (i = 0; i < 4; ++i) check(v[i] == (float)((size - 1) * 10 + i), "all_reduce max");
  for (i = 0; i < 4; ++i) v[i] = (float)(rank == 1 ? 7 : -1);
  tdist_tensor_free(t);
  OK(tdist_tensor_from_data(v, 4, TDIST_FLOAT32, &t));
  OK(tdist_broadcast_async(pg, t, 1, 60000, &work));
  OK(tdist_work_wait(work, 0));
  OK(tdist_work_free(work));
  OK(tdist_tensor_copy_to(t, v, sizeof v));
  for (i = 0; i < 4; ++i) check(v[i] == 7.0f, "broadcast from rank 1");

  /* all_gather_into_tensor */
  v[0] = (float)rank;
  OK(tdist_tensor_from_data(v, 1, TDIST_FLOAT32, &one));
  OK(tdist_tensor_zeros(size, TDIST_FLOAT32, &out));
  OK(tdist_all_gather_into_tensor(pg, out, one, 60000));
  OK(tdist_tensor_copy_to(out, gathered, sizeof(float) * (size_t)size));
  for (i = 0; i < size; ++i) check(gathered[i] == (float)i, "all_gather");

  /* a subgroup of ranks 0 and 1 */
  OK(tdist_new_group(pg, ranks, 2, &sub));
  if (rank < 2) {
    int sub_size = 0;
    check(sub != NULL, "a member gets the subgroup");
    OK(tdist_pg_size(sub, &sub_size));
    check(sub_size == 2, "the subgroup has 2 ranks");
    OK(tdist_all_reduce(sub, one, TDIST_SUM, 60000));
    OK(tdist_tensor_copy_to(one, v, sizeof(float)));
    check(v[0] == 1.0f, "the subgroup's sum is 0 + 1");
    OK(tdist_pg_free(sub));
  } else {
    check(sub == NULL, "a non-member gets NULL");
  }
  OK(tdist_barrier(pg, 60000));

  misuse(pg, t);
  /* a wait that times out: the others join the op a second later; the op
     goes on and a second wait sees it done */
  if (rank == 0) {
    OK(tdist_all_reduce_async(pg, one, TDIST_SUM, 60000, &work));
    IS(tdist_work_wait(work, 200), TDIST_ERR_TIMEOUT);
  } else {
    struct timespec second = {1, 0};
    nanosleep(&second, NULL);
    OK(tdist_all_reduce_async(pg, one, TDIST_SUM, 60000, &work));
  }
  OK(tdist_work_wait(work, 60000));
  OK(tdist_work_free(work));

  more_calls(pg, t, one, size);

  OK(tdist_tensor_free(t));
  OK(tdist_tensor_free(out));
  OK(tdist_tensor_free(one));
  OK(tdist_pg_free(pg));
  IS(tdist_pg_free(pg), TDIST_ERR_USAGE);
  printf("c_api ok (rank %d of %d)\n", rank, size);
  return 0;
}
