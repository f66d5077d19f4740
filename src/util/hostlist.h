// Slurm's host lists, the compressed node lists of SLURM_JOB_NODELIST and
// SLURM_STEP_NODELIST: "node[01-04,07]", "a1,b[2-3]", "n[1-2]-ib",
// "rack[1-2]-n[01-02]". Used by tdist-run (the master's address of a job
// srun started) and by env:// (MASTER_ADDR's fallback). No LibTorch.
//
// The syntax, as Slurm writes and reads it:
//   list   := item (',' item)*           commas inside brackets belong to the group
//   item   := (text | group)+            text: printable ASCII but for ' ' , [ ]
//   group  := '[' range (',' range)* ']'
//   range  := N | LO '-' HI              decimal digits, LO <= HI
// An item stands for the cartesian product of its groups, the leftmost
// group outermost ("rack[1-2]-n[01-02]": rack1-n01, rack1-n02, rack2-n01,
// rack2-n02); a number is zero-padded to as many digits as its range's LO
// was written with ("n[08-10]": n08, n09, n10; "n[001-003]": n001 ...).
// Hosts come in the order written; nothing is sorted or merged.
//
// Contract, for hostile input: every function reads the text once (at most
// kMaxHostListBytes) and keeps at most one item's parts, so work and memory
// are linear in the text; nothing is expanded but by expand_hosts,
// which counts first and refuses more than max_hosts names before
// allocating any. Numbers have at most 18 digits (no overflow); counts
// saturate at UINT64_MAX; a host name is at most kMaxHostNameBytes. Every
// error is a UsageError that shows the list (printable, cut short) and says
// what is wrong: empty, an empty name, an unbalanced bracket, a bad or
// reversed range, a character no host name has.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tdist::detail {

inline constexpr size_t kMaxHostListBytes = size_t(1) << 20;
inline constexpr size_t kMaxHostNameBytes = 255;

// The first host of the list, without expanding it: "node[07-09],a" ->
// "node07". Checks the whole list.
std::string first_host(std::string_view list);

// How many hosts the list names (UINT64_MAX when more).
uint64_t count_hosts(std::string_view list);

// Every host, in order; a UsageError if there are more than max_hosts.
std::vector<std::string> expand_hosts(std::string_view list, size_t max_hosts);

}  // namespace tdist::detail
