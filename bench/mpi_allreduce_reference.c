/* Reference numbers: OpenMPI's MPI_Allreduce (float, MPI_SUM), same sizes and
 * columns as `tdist-bench collectives`. Built and run by
 * bench/compare_collectives.sh when mpicc and mpirun are installed.
 *
 *   mpirun -np 2 ./mpi_allreduce_reference MIN_BYTES MAX_BYTES STEP SECONDS [JSON]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (argc < 5) {
    if (rank == 0) fprintf(stderr, "usage: mpi_allreduce_reference MIN MAX STEP SECONDS [JSON]\n");
    MPI_Finalize();
    return 2;
  }
  const double min_b = atof(argv[1]), max_b = atof(argv[2]), step = atof(argv[3]), seconds = atof(argv[4]);
  FILE* json = (rank == 0 && argc > 5) ? fopen(argv[5], "w") : NULL;
  if (json) fprintf(json, "[\n");
  if (rank == 0) {
    printf("\n# all_reduce, OpenMPI, world size %d, float32\n%12s %11s %9s %9s\n", world, "size(B)", "time(us)",
           "algbw", "busbw");
  }
  int first = 1;
  for (double b = min_b < 4 ? 4 : min_b; b <= max_b * 1.0001; b *= step) {
    const long count = (long)(b / 4);
    float* buf = malloc(sizeof(float) * (size_t)count);
    for (long i = 0; i < count; ++i) buf[i] = 1.0f;
    for (int i = 0; i < 3; ++i) MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double est = MPI_Wtime() - t0, est_max;
    MPI_Allreduce(&est, &est_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    int iters = (int)(seconds / (est_max > 1e-7 ? est_max : 1e-7));
    iters = iters < 5 ? 5 : iters > 20000 ? 20000 : iters;
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    for (int i = 0; i < iters; ++i) MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double took = (MPI_Wtime() - t0) / iters, took_max;
    MPI_Allreduce(&took, &took_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) {
      const double bytes = (double)count * 4, us = took_max * 1e6, algbw = bytes / took_max / 1e9;
      const double busbw = algbw * 2.0 * (world - 1) / world;
      printf("%12.0f %11.2f %9.2f %9.2f\n", bytes, us, algbw, busbw);
      if (json) {
        fprintf(json, "%s  {\"op\": \"all_reduce\", \"backend\": \"openmpi\", \"world_size\": %d, \"dtype\": \"float32\", "
                      "\"bytes\": %.0f, \"time_us\": %.3f, \"algbw_GBps\": %.4f, \"busbw_GBps\": %.4f, \"wrong\": 0}",
                first ? "" : ",\n", world, bytes, us, algbw, busbw);
        first = 0;
      }
    }
    free(buf);
  }
  if (json) {
    fprintf(json, "\n]\n");
    fclose(json);
  }
  MPI_Finalize();
  return 0;
}
