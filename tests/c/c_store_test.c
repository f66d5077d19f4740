/* Stores through the C ABI from C99 under tdist-run (worlds 2 and 3): a
 * FileStore at argv[1] (fresh per run) and a TCPStore on a free port,
 * set/get/add/wait between the ranks, the world group made over the
 * FileStore, and misuse. Prints "c_store ok" from every rank. */
#include <string.h>

#include "check.h"

int main(int argc, char** argv) {
  tdist_store *fs = NULL, *tcp = NULL, *none = NULL;
  tdist_pg* pg = NULL;
  tdist_tensor t = NULL;
  const char* env_rank = getenv("RANK");
  const char* env_world = getenv("WORLD_SIZE");
  char key[32], want[32], got[32];
  size_t n = 0;
  int64_t sum = 0;
  int world, r, port = 0;
  float v = 0;
  if (argc != 2 || !env_rank || !env_world) {
    fprintf(stderr, "usage: RANK=r WORLD_SIZE=n c_store_test FILE (tdist-run sets them)\n");
    return 2;
  }
  rank = atoi(env_rank);
  world = atoi(env_world);

  OK(tdist_file_store_new(argv[1], 30000, &fs));
  snprintf(key, sizeof key, "rank-%d", rank);
  snprintf(want, sizeof want, "hello from %d", rank);
  OK(tdist_store_set(fs, key, want, strlen(want)));
  for (r = 0; r < world; ++r) {
    const char* k = key;
    snprintf(key, sizeof key, "rank-%d", r);
    OK(tdist_store_wait(fs, &k, 1, 30000));
    OK(tdist_store_get(fs, key, got, sizeof got, &n, 30000));
    snprintf(want, sizeof want, "hello from %d", r);
    check(n == strlen(want) && memcmp(got, want, n) == 0, "every rank's value comes back");
  }
  IS(tdist_store_get(fs, key, got, 3, &n, 30000), TDIST_ERR_USAGE);
  check(n == strlen(want), "a too-small buffer is refused, with the size needed");
  OK(tdist_store_add(fs, "count", 1, &sum));
  check(sum >= 1 && sum <= world, "add returns the running sum");
  IS(tdist_store_get(fs, "never-set", got, sizeof got, &n, 200), TDIST_ERR_TIMEOUT);

  /* a TCPStore on a free port: rank 0 serves and publishes the port */
  if (rank == 0) {
    OK(tdist_tcp_store_new("127.0.0.1", 0, 1, 0, 30000, &tcp));
    OK(tdist_store_port(tcp, &port));
    check(port > 0, "the server took a free port");
    OK(tdist_store_set(fs, "tcp-port", &port, sizeof port));
  } else {
    OK(tdist_store_get(fs, "tcp-port", &port, sizeof port, &n, 30000));
    OK(tdist_tcp_store_new("127.0.0.1", port, 0, 0, 30000, &tcp));
  }
  OK(tdist_store_add(tcp, "tcp-count", 1, &sum));
  {
    const char* k = "tcp-done";
    if (sum == world) OK(tdist_store_set(tcp, k, "x", 1));
    OK(tdist_store_wait(tcp, &k, 1, 30000));
  }
  IS(tdist_tcp_store_new("127.0.0.1", 0, 0, 0, 1000, &none), TDIST_ERR_USAGE); /* port 0 on a client */
  IS(tdist_store_port(fs, &port), TDIST_ERR_USAGE);                              /* not a TCPStore */

  /* the world group over the FileStore */
  IS(tdist_init_process_group_with_store(fs, world, world, "auto", 30000, &pg), TDIST_ERR_USAGE);
  OK(tdist_init_process_group_with_store(fs, rank, world, "auto", 60000, &pg));
  v = (float)(rank + 1);
  OK(tdist_tensor_from_data(&v, 1, TDIST_FLOAT32, &t));
  OK(tdist_all_reduce(pg, t, TDIST_SUM, 60000));
  OK(tdist_tensor_copy_to(t, &v, sizeof v));
  check(v == (float)(world * (world + 1) / 2), "all_reduce over the store's group");
  IS(tdist_all_reduce((tdist_pg*)fs, t, TDIST_SUM, 1000), TDIST_ERR_USAGE); /* a store is not a group */
  OK(tdist_barrier(pg, 60000));
  OK(tdist_tensor_free(t));
  OK(tdist_pg_free(pg));
  OK(tdist_store_free(tcp));
  OK(tdist_store_free(fs));
  IS(tdist_store_free(fs), TDIST_ERR_USAGE);
  printf("c_store ok (rank %d of %d)\n", rank, world);
  return 0;
}
