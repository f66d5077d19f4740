// --nnodes MIN:MAX: tdist-run's elastic job, the glue between the
// rendezvous (run/elastic_agent.h) and this node's ranks
// (run/supervisor.h). Rounds of the rendezvous, each a start of the job
// with whoever is there; a rank's failure on any node, a node lost or a
// node arriving stops every node's ranks, and they meet again. Failures
// count against --max-restarts; nodes coming or going do not.
//
// Owns: the elastic agent, for the job's length. Needs: the options, and
// the supervisor, whose guardian it starts once the agent (which may fork
// the rendezvous store's host) is made.
#pragma once

#include "run/launch_options.h"

namespace tdist_run {

class Supervisor;

// Runs the job; the launcher's exit code.
int run_elastic(const Options& o, TokenPlan token, Supervisor& supervisor);

}  // namespace tdist_run
