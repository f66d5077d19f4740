// What the ranks' flight recorder dumps say together (tdist-trace analyze,
// docs/observability.md): per group, the ranks lined up by
// collective_seq_id (a group's collectives start and complete in that
// order on every rank), to name who a hang waits for and where ranks
// called different collectives. No LibTorch.
//
// Findings, most important first in the report:
//   - mismatch: the first sequence number of a group at which the ranks
//     that still hold it in their rings disagree on the op, the dtypes or
//     (for ops whose inputs must be equal everywhere: all_reduce,
//     all_reduce_coalesced, broadcast, reduce, barrier,
//     all_gather_into_tensor, reduce_scatter_tensor) the input sizes;
//   - never_called / in_progress: the lowest sequence number of a group not
//     completed on every member with a dump: who is in it and for how long
//     (dump time minus started, else created), who never enqueued it and
//     what those did last (their last completed op of the group, an op
//     pending in another group, or nothing pending: busy outside tdist);
//     pg_status's counters count where the ring dropped old entries;
//   - failed: an entry whose state is failed, with its error;
//   - p2p_pending: a send/recv not retired (p2p ops are not lined up);
//   - missing_dump: a rank of the world (0 .. world_size-1) with no dump;
//   - inconsistent: dumps that disagree on the world size or a group's
//     ranks, or two dumps of one rank.
// Ranks are global ranks; groups are matched by name; a group's ranks come
// from pg_config (or, where no dump gives them, the dumps that name it).
//
// exit_code: 0 when there is no finding (every collective enqueued was
// completed everywhere, nothing pending or failed), else 1. (The CLI's 2,
// unreadable input or no dumps, is not decided here.) Strings from the
// dumps are made printable (control bytes as \xNN) in the report.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trace/dump_reader.h"

namespace tdist::trace {

enum class FindingKind { mismatch, never_called, in_progress, failed, p2p_pending, missing_dump, inconsistent };
const char* finding_kind_name(FindingKind k);

struct Finding {
  FindingKind kind = FindingKind::inconsistent;
  std::string group;                 // "" when about no one group
  int64_t seq = 0;                   // collective (or p2p) sequence number; 0: none
  std::string op;                    // "all_reduce", ...; "" when unknown
  std::vector<int> ranks;            // the ranks at fault: never called it, failed, no dump, the mismatch's minority
  std::vector<int> waiting;          // ranks in the op (never_called, in_progress)
  std::vector<int> completed;        // ranks that completed it (never_called)
  std::vector<int> no_dump;          // members of the group with no dump
  double waited_s = 0;               // the longest a rank has been in it, by its dump's clock
  std::string message;               // one line
  std::vector<std::string> details;  // context lines
};

struct GroupSummary {
  std::string name;
  std::vector<int> ranks;         // global ranks
  int64_t completed_through = 0;  // every member with a dump completed 1 .. this
};

struct Analysis {
  int world_size = 0;                // the largest the dumps give
  std::vector<int> dumped;           // ranks with a dump
  std::vector<GroupSummary> groups;  // by name
  std::vector<Finding> findings;     // most important first
  std::string report;                // a few lines of text, ending in '\n'
  int exit_code = 0;                 // 0: all agree, 1: findings
};

Analysis analyze(const std::vector<RankDump>& dumps);

// The analysis as JSON text (one object: exit_code, world_size, dumped,
// groups, findings), for --json.
std::string analysis_json(const Analysis& a);

// "rank 3", "ranks 0-3, 5", "no rank".
std::string ranks_text(std::vector<int> ranks);

}  // namespace tdist::trace
