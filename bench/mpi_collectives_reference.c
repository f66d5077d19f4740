/* Reference numbers: OpenMPI's collectives (float, MPI_SUM), the same sizes
 * and columns as `tdist-bench collectives`: all_reduce (MPI_Allreduce in
 * place), reduce_scatter (MPI_Reduce_scatter_block; size = the input),
 * all_gather (MPI_Allgather; size = the output), broadcast (MPI_Bcast).
 * Each call is timed alone; a row gives the median and 99th percentile of
 * the slowest rank's times. Built and run by bench/compare_collectives.sh
 * when mpicc and mpirun are installed.
 *
 *   mpirun -np 2 ./mpi_collectives_reference [--barrier-each] OPS MIN_BYTES MAX_BYTES STEP SECONDS [JSON]
 *   (OPS: comma-separated, e.g. all_reduce,reduce_scatter,all_gather)
 *
 * --barrier-each: an untimed MPI_Barrier before every timed call (as
 * `tdist-bench collectives --barrier-each`), so that no rank runs ahead:
 * without it a small MPI_Bcast's root returns at once and fills its
 * receivers' queue many calls ahead, and the receivers' time is their own
 * call's alone.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

/* The p-th percentile of n sorted values, interpolated. */
static double percentile(const double* v, int n, double p) {
  const double at = p / 100.0 * (n - 1);
  const int lo = (int)at;
  return lo + 1 < n ? v[lo] + (at - lo) * (v[lo + 1] - v[lo]) : v[n - 1];
}

static double bus_factor(const char* op, int n) {
  if (!strcmp(op, "all_reduce")) return 2.0 * (n - 1) / n;
  if (!strcmp(op, "broadcast")) return 1.0;
  return (double)(n - 1) / n;
}

/* The op, resolved from its name before the timed loop (as tdist-bench does). */
enum kind { ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST };

static enum kind kind_of(const char* op) {
  if (!strcmp(op, "all_reduce")) return ALL_REDUCE;
  if (!strcmp(op, "reduce_scatter")) return REDUCE_SCATTER;
  if (!strcmp(op, "all_gather")) return ALL_GATHER;
  return BROADCAST;
}

static void run(enum kind k, float* in, float* out, long count, int world) {
  switch (k) {
    case ALL_REDUCE:
      MPI_Allreduce(MPI_IN_PLACE, in, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
    case REDUCE_SCATTER:
      MPI_Reduce_scatter_block(in, out, (int)(count / world), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
    case ALL_GATHER:
      MPI_Allgather(in, (int)(count / world), MPI_FLOAT, out, (int)(count / world), MPI_FLOAT, MPI_COMM_WORLD);
      break;
    case BROADCAST:
      MPI_Bcast(in, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
      break;
  }
}

/* Times iters calls; returns the slowest rank's times, sorted (caller frees). */
static int barrier_each = 0;

static double* timed(enum kind op, float* in, float* out, long count, int world, int iters) {
  double* mine = malloc(sizeof(double) * (size_t)iters);
  double* slowest = malloc(sizeof(double) * (size_t)iters);
  MPI_Barrier(MPI_COMM_WORLD);
  for (int i = 0; i < iters; ++i) {
    if (barrier_each) MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    run(op, in, out, count, world);
    mine[i] = MPI_Wtime() - t0;
  }
  MPI_Allreduce(mine, slowest, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  free(mine);
  qsort(slowest, (size_t)iters, sizeof(double), cmp_double);
  return slowest;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (argc > 1 && !strcmp(argv[1], "--barrier-each")) {
    barrier_each = 1;
    --argc;
    ++argv;
  }
  if (argc < 6) {
    if (rank == 0) fprintf(stderr, "usage: mpi_collectives_reference [--barrier-each] OPS MIN MAX STEP SECONDS [JSON]\n");
    MPI_Finalize();
    return 2;
  }
  char* ops = strdup(argv[1]);
  const double min_b = atof(argv[2]), max_b = atof(argv[3]), step = atof(argv[4]), seconds = atof(argv[5]);
  FILE* json = (rank == 0 && argc > 6) ? fopen(argv[6], "w") : NULL;
  if (json) fprintf(json, "[\n");
  int first = 1;
  for (char* op = strtok(ops, ","); op; op = strtok(NULL, ",")) {
    if (rank == 0) {
      printf("\n# %s, OpenMPI, world size %d, float32\n%12s %11s %11s %9s %9s\n", op, world, "size(B)", "time(us)",
             "p99(us)", "algbw", "busbw");
    }
    const int sharded = !strcmp(op, "reduce_scatter") || !strcmp(op, "all_gather");
    for (double b = min_b < 4 ? 4 : min_b; b <= max_b * 1.0001; b *= step) {
      long count = (long)(b / 4);
      if (sharded) count = count / world * world;
      if (count == 0) continue;
      float* in = malloc(sizeof(float) * (size_t)count);
      float* out = malloc(sizeof(float) * (size_t)count);
      for (long i = 0; i < count; ++i) in[i] = out[i] = 1.0f;
      const enum kind k = kind_of(op);
      for (int i = 0; i < 3; ++i) run(k, in, out, count, world);
      double* est = timed(k, in, out, count, world, 3);
      int iters = (int)(seconds / (est[1] > 1e-7 ? est[1] : 1e-7));
      free(est);
      iters = iters < 20 ? 20 : iters > 20000 ? 20000 : iters;
      double* t = timed(k, in, out, count, world, iters);
      if (rank == 0) {
        const double bytes = (double)count * 4, med = percentile(t, iters, 50), p99 = percentile(t, iters, 99);
        const double algbw = bytes / med / 1e9, busbw = algbw * bus_factor(op, world);
        printf("%12.0f %11.2f %11.2f %9.2f %9.2f\n", bytes, med * 1e6, p99 * 1e6, algbw, busbw);
        if (json) {
          fprintf(json,
                  "%s  {\"op\": \"%s\", \"backend\": \"openmpi\", \"world_size\": %d, \"dtype\": \"float32\", "
                  "\"bytes\": %.0f, \"time_us\": %.3f, \"p99_us\": %.3f, \"algbw_GBps\": %.4f, \"busbw_GBps\": %.4f}",
                  first ? "" : ",\n", op, world, bytes, med * 1e6, p99 * 1e6, algbw, busbw);
          first = 0;
        }
      }
      free(t);
      free(in);
      free(out);
    }
  }
  if (json) {
    fprintf(json, "\n]\n");
    fclose(json);
  }
  free(ops);
  MPI_Finalize();
  return 0;
}
