/* The C tests' checks: a failed one prints the rank, what was checked and
 * tdist's last error, and exits 1 (tdist-run then fails the job). */
#ifndef TDIST_TESTS_C_CHECK_H
#define TDIST_TESTS_C_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "tdist/c/tdist.h"

static int rank = -1;

static void check(int ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "rank %d: FAILED: %s (last error: %s)\n", rank, what, tdist_last_error());
    exit(1);
  }
}

#define OK(call) check((call) == TDIST_OK, #call)
#define IS(call, status) check((call) == (status), #call " is " #status)
#define NN(p) check((p) != NULL, #p " is not NULL")

#endif
