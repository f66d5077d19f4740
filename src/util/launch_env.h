// What launchers put in a process's environment, read the same way by every
// part of tdist: env:// (store/rendezvous.cpp), tdist-run under srun
// (tools/run/cluster_env.cpp), the nccl backend's choice of GPU (the local
// rank) and FSDP's hybrid shard groups (the local world size). torchrun's
// names come first, then OpenMPI's (mpirun), then Slurm's (srun). No LibTorch.
//
// Slurm's variables are those srun documents under OUTPUT ENVIRONMENT
// VARIABLES; an srun step also has SLURM_STEP_* ones (its own nodes and
// tasks), which Slurm's batch script lacks.
//
// A value set but empty counts as unset (as env:// always did). Nothing
// here throws but slurm_default_port, on a job id that is no number.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

namespace tdist::detail {

// An environment lookup (RendezvousOptions::getenv's type); nullptr: getenv.
using EnvLookup = const char* (*)(const char*);

struct EnvValue {
  const char* name;  // which variable it came from
  std::string value;
};

// The first of names that is set, with its value.
std::optional<EnvValue> first_set(EnvLookup env, std::initializer_list<const char*> names);

struct EnvNumber {
  int64_t value;
  const char* name;
};

// This process's index among the processes on its node: LOCAL_RANK,
// OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID, the first set; nullopt when
// none is, or it is no integer >= 0.
std::optional<EnvNumber> local_rank_from_env(EnvLookup env = nullptr);

// How many processes of the job are on this node: LOCAL_WORLD_SIZE,
// OMPI_COMM_WORLD_LOCAL_SIZE, or under srun the count for SLURM_NODEID in
// SLURM_STEP_TASKS_PER_NODE; nullopt when none is set, or it is no
// integer >= 1.
std::optional<EnvNumber> local_world_size_from_env(EnvLookup env = nullptr);

// The job's nodes: SLURM_STEP_NODELIST (an srun step's), SLURM_JOB_NODELIST
// or SLURM_NODELIST, in Slurm's host list syntax (util/hostlist.h).
std::optional<EnvValue> slurm_node_list(EnvLookup env);

// SLURM_JOB_ID (or the older SLURM_JOBID).
std::optional<EnvValue> slurm_job_id(EnvLookup env);

// MASTER_PORT's default for a Slurm job: 20000 + job id mod 10000. From
// 20000 to 29999: below Linux's ephemeral ports (32768 up), so no outgoing
// connection holds it, and two jobs on one node differ unless their ids
// differ by a multiple of 10000 (then set MASTER_PORT). A UsageError naming
// the variable when the id is no number.
int slurm_default_port(const EnvValue& job_id);

// The tasks on node `node` (from 0) in Slurm's per-node counts, as in
// SLURM_STEP_TASKS_PER_NODE: "2(x3),1" is 2, 2, 2 and 1. nullopt when the
// text is malformed or has no such node. Linear in the text, no overflow.
std::optional<int64_t> slurm_tasks_on_node(std::string_view counts, int64_t node);

}  // namespace tdist::detail
