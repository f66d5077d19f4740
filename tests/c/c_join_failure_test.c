/* tdist_join_free when the Join's last join() fails: rank 1 leaves
 * without joining, so rank 0's join cannot finish. The call must return
 * an error within the group's timeout (3 s here), not abort the process.
 * Prints "join_free failed cleanly" on rank 0. World 2 under tdist-run. */
#define _POSIX_C_SOURCE 199309L
#include <string.h>
#include <time.h>

#include "check.h"

int main(void) {
  tdist_pg* pg = NULL;
  tdist_module* m = NULL;
  tdist_ddp* ddp = NULL;
  tdist_join* join = NULL;
  tdist_tensor w = NULL;
  const char* name = "w";
  const int64_t shape[1] = {4};
  const float values[4] = {1, 2, 3, 4};
  tdist_status s;
  OK(tdist_init_process_group("auto", 3000, &pg));
  OK(tdist_pg_rank(pg, &rank));
  OK(tdist_tensor_new(values, shape, 1, TDIST_FLOAT32, 1, &w));
  OK(tdist_module_new(&name, &w, 1, &m));
  OK(tdist_ddp_new(m, NULL, NULL, &ddp));
  OK(tdist_join_new(&ddp, 1, NULL, 0, 1, &join));
  if (rank == 1) return 0; /* leaves without joining */
  {
    struct timespec half = {0, 500000000};
    nanosleep(&half, NULL);
  }
  s = tdist_join_free(join);
  check(s == TDIST_ERR_COMM || s == TDIST_ERR_TIMEOUT, "tdist_join_free returns a peer or timeout error");
  check(strstr(tdist_last_error(), "tdist_join_free") != NULL, "the error names the call");
  printf("join_free failed cleanly: %s\n", tdist_last_error());
  fflush(stdout);
  return 0;
}
