// tdist-run's options from where clusters put them, for what the command
// line leaves out. The order, first wins:
//   1. the command line;
//   2. torchrun's environment names for its flags, PET_ and the flag in
//      capitals with '_' for '-' (PET_NPROC_PER_NODE, PET_NNODES,
//      PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_MAX_RESTARTS,
//      PET_RDZV_BACKEND, PET_RDZV_ENDPOINT, PET_RDZV_ID, PET_RDZV_CONF,
//      PET_LOCAL_ADDR): what Kubeflow's training-operator sets on each pod
//      of a PyTorchJob. PET_NODE_RANK only for a job of fixed size (torchrun
//      ignores the node rank with a rendezvous backend, and the operator
//      sets it on elastic jobs that have a Master too);
//   3. Slurm, for a launcher srun started on each node (one task per node):
//      --nnodes from SLURM_STEP_NUM_NODES, --node-rank from SLURM_NODEID,
//      and for more than one node --master-addr from MASTER_ADDR or else
//      the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), and
//      --master-port from MASTER_PORT or else 20000 + SLURM_JOB_ID mod
//      10000 (util/launch_env.h). A step with other than one task per node,
//      or Slurm's batch script of a job of several nodes (no srun step),
//      is refused, naming what to run instead;
//   4. the defaults.
// tdist-run never takes its ranks' RANK or WORLD_SIZE from its own
// environment: Kubeflow's operator sets them to the pod's index and the
// pods' count (times nprocPerNode since v1.7), which are not the ranks'.
// When a fixed-size job of several nodes has no node rank from 1. to 3.,
// it is node 0, as with torchrun (which never reads RANK), and a RANK
// other than 0 in the environment is pointed out on stderr.
#pragma once

#include <CLI/CLI.hpp>

#include <map>
#include <string>

#include "run/launch_options.h"

namespace tdist_run {

// Gives each of torchrun's flags in app (but --node-rank) its PET_ name:
// CLI11 then reads it for a flag the command line lacks.
void add_torchrun_env_names(CLI::App& app);

// Where the options' values came from, for messages.
struct ClusterValues {
  bool master_port = false;                  // Slurm gave "master-port"
  std::map<std::string, std::string> from;   // "nnodes" -> "PET_NNODES", ...

  // "--nnodes", or "--nnodes (from PET_NNODES)".
  std::string name(const std::string& dashed) const;
};

// After app parsed argv: fills in v (the options' text by dashed name) and
// o.master_addr from PET_NODE_RANK and Slurm as above; exits 2 through
// usage() on what cannot work.
ClusterValues take_from_cluster(const CLI::App& app, int argc, char** argv, std::map<std::string, std::string>& v,
                                Options& o);

}  // namespace tdist_run
