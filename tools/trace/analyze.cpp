// Lining the ranks' dumps up per group. The contract is in analyze.h.
#include "trace/analyze.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "util/printable.h"

namespace tdist::trace {

const char* finding_kind_name(FindingKind k) {
  switch (k) {
    case FindingKind::mismatch: return "mismatch";
    case FindingKind::never_called: return "never_called";
    case FindingKind::in_progress: return "in_progress";
    case FindingKind::failed: return "failed";
    case FindingKind::p2p_pending: return "p2p_pending";
    case FindingKind::missing_dump: return "missing_dump";
    case FindingKind::inconsistent: return "inconsistent";
  }
  return "?";
}

std::string ranks_text(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  if (ranks.empty()) return "no rank";
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

namespace {

using detail::printable;

std::string in_quotes(const std::string& group) { return "'" + printable(group, 128) + "'"; }
std::string op_name(const std::string& op) { return op.empty() ? "collective" : printable(op, 64); }

// Seconds from `t_ns` to the dump's time; -1 when either is unknown.
double seconds_before(const RankDump& d, int64_t t_ns) {
  if (d.dump_time_ns <= 0 || t_ns <= 0) return -1;
  return d.dump_time_ns > t_ns ? static_cast<double>(d.dump_time_ns - t_ns) / 1e9 : 0.0;
}

std::string secs(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

// Ops whose input sizes must be the same on every rank.
bool sizes_must_match(const std::string& op) {
  static const std::set<std::string> ops = {
      "all_reduce",           "all_reduce_coalesced", "broadcast", "reduce", "barrier", "all_gather_into_tensor",
      "reduce_scatter_tensor"};
  return ops.count(op) != 0;
}

std::string sizes_text(const std::vector<std::vector<int64_t>>& sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s += i ? ", [" : "[";
    for (size_t j = 0; j < sizes[i].size(); ++j) s += (j ? ", " : "") + std::to_string(sizes[i][j]);
    s += "]";
  }
  return s + "]";
}

// "all_reduce Float[[4096]]"; `compare`: without the sizes where they may differ.
std::string signature(const FrEntry& e, bool compare) {
  std::string s = op_name(e.op);
  if (!e.input_dtypes.empty()) {
    s += " ";
    for (size_t i = 0; i < e.input_dtypes.size(); ++i) s += (i ? "," : "") + printable(e.input_dtypes[i], 32);
  }
  if (!e.input_sizes.empty() && (!compare || sizes_must_match(e.op))) s += sizes_text(e.input_sizes);
  if (!compare && !e.site.empty()) s += " (" + printable(e.site, 64) + ")";
  return s;
}

// Which side of a mismatch skipped an op, from the ranks' shared history
// (everything before the mismatch agreed): side X skipped when its op is
// what followed the other side's op the last time that op came. nullptr
// when the history does not say (or says it of more than one side).
// `at`: each side's signature at the mismatch; `history`: one rank's
// collectives of the group, by seq.
const std::string* skipping_side(const std::vector<std::string>& at, const std::map<int64_t, const FrEntry*>& history,
                                 int64_t seq) {
  const std::string* found = nullptr;
  for (size_t x = 0; x < at.size(); ++x) {
    for (size_t y = 0; y < at.size(); ++y) {
      if (x == y) continue;
      // The last earlier op like y's, and the one after it.
      int64_t j = 0;
      for (auto it = history.lower_bound(seq); it != history.begin();) {
        --it;
        if (signature(*it->second, true) == at[y]) {
          j = it->first;
          break;
        }
      }
      if (j == 0) continue;
      const auto next = history.find(j + 1);
      if (next == history.end() || j + 1 >= seq || signature(*next->second, true) != at[x]) continue;
      if (found && *found != at[x]) return nullptr;
      found = &at[x];
    }
  }
  return found;
}

// "all_reduce #12 of group 'world'", "send #3 to rank 1 of group 'world'".
std::string op_text(const FrEntry& e, const std::vector<int>& group_ranks) {
  const int64_t seq = e.is_p2p ? e.p2p_seq_id : e.collective_seq_id;
  // An op is numbered when it starts: one still queued has no number yet.
  std::string s = op_name(e.op) + (seq > 0 ? " #" + std::to_string(seq) : std::string(" (queued, not started)"));
  if (e.is_p2p && e.peer >= 0) {
    const bool known = static_cast<size_t>(e.peer) < group_ranks.size();
    s += std::string(e.op == "recv" ? " from " : " to ") +
         (known ? "rank " + std::to_string(group_ranks[e.peer]) : "group rank " + std::to_string(e.peer));
  }
  return s + " of group " + in_quotes(e.group);
}

// One rank's view of one group.
struct View {
  const RankDump* dump = nullptr;
  bool has_group = false;
  int64_t enqueued = 0, started = 0, completed = 0;  // enqueued: how many (the highest number they will have)
  std::map<int64_t, const FrEntry*> coll;  // collectives in the ring, by seq (the latest record wins)
};

struct Group {
  std::string name;
  std::vector<int> ranks;     // global
  std::map<int, View> views;  // members with a dump
  std::vector<int> no_dump;
};

class Analyzer {
 public:
  explicit Analyzer(const std::vector<RankDump>& dumps) {
    for (const RankDump& d : dumps) {
      if (!by_rank_.emplace(d.rank, &d).second) {
        add(FindingKind::inconsistent, "", {d.rank},
            "two dumps of rank " + std::to_string(d.rank) + " (" + printable(d.path) + "); the first is used");
        continue;
      }
      a.world_size = std::max(a.world_size, d.world_size);
      a.dumped.push_back(d.rank);
    }
    std::set<int> sizes;
    for (const auto& [r, d] : by_rank_) sizes.insert(d->world_size);
    if (sizes.size() > 1) {
      std::string list;
      size_t n = 0;
      for (const auto& [r, d] : by_rank_) {
        if (++n > 8) {
          list += ", ...";
          break;
        }
        list += (list.empty() ? "" : ", ") + std::to_string(r) + ": " + std::to_string(d->world_size);
      }
      add(FindingKind::inconsistent, "", {}, "the dumps disagree on the world size (rank: world size " + list + ")");
    }
  }

  Analysis run() {
    collect_groups();
    for (Group& g : groups_) {
      mismatch(g);
      pending(g);
      GroupSummary s{g.name, g.ranks, 0};
      if (!g.views.empty()) {
        s.completed_through = INT64_MAX;
        for (const auto& [r, v] : g.views) s.completed_through = std::min(s.completed_through, v.completed);
      }
      a.groups.push_back(s);
    }
    failed_and_p2p();
    for (int r = 0; r < a.world_size; ++r) {
      if (!by_rank_.count(r))
        add(FindingKind::missing_dump, "", {r},
            "rank " + std::to_string(r) + " wrote no dump (dead, or hung outside tdist?)");
    }
    std::stable_sort(a.findings.begin(), a.findings.end(), [](const Finding& x, const Finding& y) {
      if (x.kind != y.kind) return x.kind < y.kind;
      return x.waited_s > y.waited_s;  // the longest wait first
    });
    a.exit_code = a.findings.empty() ? 0 : 1;
    report();
    return std::move(a);
  }

 private:
  Analysis a;
  std::map<int, const RankDump*> by_rank_;
  std::vector<Group> groups_;
  std::map<std::string, size_t> index_;            // groups_ by name
  std::map<int, const FrEntry*> oldest_pending_;  // each dump's oldest op not retired

  Finding& add(FindingKind kind, const std::string& group, std::vector<int> ranks, std::string message) {
    Finding f;
    f.kind = kind;
    f.group = group;
    f.ranks = std::move(ranks);
    f.message = std::move(message);
    a.findings.push_back(std::move(f));
    return a.findings.back();
  }

  // Groups by name, each with a view per member that has a dump. One pass
  // over each dump: the work is linear in what the dumps hold.
  void collect_groups() {
    std::map<std::string, std::pair<int, std::vector<int>>> config;  // name -> (rank that gave it, ranks)
    std::map<std::string, std::map<int, View>> named;                 // the dumps that name each group
    for (const auto& [r, d] : by_rank_) {
      for (const auto& [name, c] : d->groups) {
        named[name][r].has_group = true;
        if (c.ranks.empty()) continue;
        const auto [it, fresh] = config.emplace(name, std::make_pair(r, c.ranks));
        if (!fresh && it->second.second != c.ranks) {
          add(FindingKind::inconsistent, name, {it->second.first, r},
              "ranks " + std::to_string(it->second.first) + " and " + std::to_string(r) +
                  " disagree on the ranks of group " + in_quotes(name));
        }
      }
      for (const auto& [name, st] : d->pg_status) {
        View& v = named[name][r];
        v.has_group = true;
        v.enqueued = st.last_enqueued_collective;
        v.started = st.last_started_collective;
        v.completed = st.last_completed_collective;
      }
      const FrEntry*& oldest = oldest_pending_[r];
      for (const FrEntry& e : d->entries) {
        View& v = named[e.group][r];
        v.has_group = true;
        const bool pending = e.state == FrState::scheduled || e.state == FrState::started;
        if (pending && (!oldest || e.record_id < oldest->record_id)) oldest = &e;
        if (e.is_p2p || e.collective_seq_id <= 0) continue;  // unnumbered: queued, not started
        const FrEntry*& slot = v.coll[e.collective_seq_id];
        if (!slot || e.record_id >= slot->record_id) slot = &e;
      }
    }
    for (auto& [name, views] : named) {
      Group g;
      g.name = name;
      const auto c = config.find(name);
      if (c != config.end()) {
        g.ranks = c->second.second;
      } else {
        for (const auto& [r, v] : views) g.ranks.push_back(r);
      }
      for (const int r : g.ranks) {
        const auto d = by_rank_.find(r);
        if (d == by_rank_.end()) {
          g.no_dump.push_back(r);
          continue;
        }
        const auto it = views.find(r);
        View v = it == views.end() ? View() : std::move(it->second);
        v.dump = d->second;
        for (const auto& [seq, e] : v.coll) {
          v.enqueued = std::max(v.enqueued, seq);
          if (e->state != FrState::scheduled) v.started = std::max(v.started, seq);
          if (e->state == FrState::completed) v.completed = std::max(v.completed, seq);
        }
        g.views.emplace(r, std::move(v));
      }
      index_.emplace(name, groups_.size());
      groups_.push_back(std::move(g));
    }
  }

  // The first seq at which the ranks that hold it disagree.
  void mismatch(const Group& g) {
    std::map<int64_t, std::vector<std::pair<int, const FrEntry*>>> by_seq;
    for (const auto& [r, v] : g.views) {
      for (const auto& [seq, e] : v.coll) by_seq[seq].emplace_back(r, e);
    }
    for (const auto& [seq, held] : by_seq) {
      std::map<std::string, std::vector<int>> classes;
      std::map<std::string, std::string> shown;
      for (const auto& [r, e] : held) {
        const std::string key = signature(*e, true);
        classes[key].push_back(r);
        shown.emplace(key, signature(*e, false));
      }
      if (classes.size() < 2) continue;
      std::vector<std::pair<std::string, std::vector<int>>> order(classes.begin(), classes.end());
      std::sort(order.begin(), order.end(), [](const auto& x, const auto& y) {
        return x.second.size() != y.second.size() ? x.second.size() < y.second.size() : x.second[0] < y.second[0];
      });
      // Who skipped an op, when the shared history says it (two sides
      // of one rank each have no minority).
      std::vector<std::string> keys;
      for (const auto& [key, ranks] : order) keys.push_back(key);
      const auto& history = g.views.at(order[0].second[0]).coll;
      const std::string* skipper = skipping_side(keys, history, seq);
      if (skipper) {
        std::stable_partition(order.begin(), order.end(), [&](const auto& c) { return c.first == *skipper; });
      }
      std::string msg = "mismatch at #" + std::to_string(seq) + " of group " + in_quotes(g.name) + ": ";
      for (size_t i = 0; i < order.size(); ++i)
        msg += (i ? ", " : "") + ranks_text(order[i].second) + " called " + shown[order[i].first];
      if (skipper) {
        std::string skipped;
        for (const auto& [key, ranks] : order) {
          if (key != *skipper) skipped = shown[key];
        }
        msg += "; " + ranks_text(order[0].second) + " skipped " + skipped +
               " (what it called is what came next in earlier steps)";
      }
      Finding& f = add(FindingKind::mismatch, g.name, order[0].second, msg);
      f.seq = seq;
      for (const auto& [r, e] : held) {
        if (r == order[0].second[0]) f.op = e->op;  // the minority's (or the skipper's) op
      }
      return;
    }
  }

  // The lowest seq not completed on every member with a dump.
  void pending(const Group& g) {
    if (g.views.empty()) return;
    int64_t low = INT64_MAX, high = 0;
    for (const auto& [r, v] : g.views) {
      low = std::min(low, v.completed);
      high = std::max(high, v.enqueued);
    }
    if (low >= high) return;
    const int64_t seq = low + 1;
    std::vector<int> never, waiting, done, queued, failed;
    const FrEntry* any = nullptr;
    double waited = -1;
    for (const auto& [r, v] : g.views) {
      if (v.completed >= seq) {
        done.push_back(r);
        continue;
      }
      if (v.enqueued < seq) {
        never.push_back(r);
        continue;
      }
      waiting.push_back(r);
      const auto it = v.coll.find(seq);
      if (it == v.coll.end()) {
        // Ops are numbered as they start: queued behind another, it has no
        // number (and no entry under one) yet.
        if (v.started < seq) queued.push_back(r);
        continue;
      }
      const FrEntry& e = *it->second;
      if (!any || !any->time_started_ns) any = &e;
      if (e.state == FrState::scheduled) queued.push_back(r);
      if (e.state == FrState::failed) failed.push_back(r);
      waited = std::max(waited, seconds_before(*v.dump, e.time_started_ns ? e.time_started_ns : e.time_created_ns));
    }
    // Failed everywhere it was called, with no one missing: the failed
    // findings say it.
    if (never.empty() && g.no_dump.empty() && failed.size() == waiting.size()) return;
    if (!any) {
      for (const auto& [r, v] : g.views) {
        const auto it = v.coll.find(seq);
        if (it != v.coll.end()) any = it->second;
      }
    }
    const std::string what =
        op_name(any ? any->op : "") + " #" + std::to_string(seq) + " of group " + in_quotes(g.name);
    const std::string since = waited >= 0 ? " for " + secs(waited) : "";
    std::string msg;
    const bool plural = waiting.size() != 1;
    if (!never.empty()) {
      msg = ranks_text(never) + " never called " + what;
      if (!waiting.empty()) msg += "; " + ranks_text(waiting) + (plural ? " have" : " has") + " waited in it" + since;
    } else if (!g.no_dump.empty()) {
      msg = what + ": " + ranks_text(waiting) + (plural ? " have" : " has") + " waited in it" + since;
    } else {
      msg = what + " is in progress on " + ranks_text(waiting) + since + " (not completed on any)";
    }
    if (!done.empty()) msg += "; " + ranks_text(done) + " completed it";
    if (!g.no_dump.empty()) msg += "; " + ranks_text(g.no_dump) + " wrote no dump";
    Finding& f = add(never.empty() && g.no_dump.empty() ? FindingKind::in_progress : FindingKind::never_called, g.name,
                     never.empty() ? g.no_dump : never, msg);
    f.seq = seq;
    f.op = any ? any->op : "";
    f.waiting = waiting;
    f.completed = done;
    f.no_dump = g.no_dump;
    f.waited_s = std::max(waited, 0.0);
    if (!queued.empty()) f.details.push_back(ranks_text(queued) + " queued it but had not started it");
    for (size_t i = 0; i < never.size() && i < 4; ++i) f.details.push_back(last_doings(g, g.views.at(never[i])));
    if (never.size() > 4) f.details.push_back("(and " + std::to_string(never.size() - 4) + " more ranks)");
  }

  // What a rank that never called a group's op did last.
  std::string last_doings(const Group& g, const View& v) {
    const RankDump& d = *v.dump;
    std::string s = "rank " + std::to_string(d.rank) + ": ";
    if (!v.has_group) s += "has no group " + in_quotes(g.name) + " (never created it?); ";
    const FrEntry* last = nullptr;
    for (const auto& [seq, e] : v.coll) {
      if (e->state == FrState::completed) last = e;
    }
    if (last) {
      s += "last completed " + op_text(*last, g.ranks);
      const double ago = seconds_before(d, last->time_completed_ns);
      if (ago >= 0) s += " " + secs(ago) + " before its dump";
    } else if (v.completed > 0) {
      s += "last completed #" + std::to_string(v.completed) + " of group " + in_quotes(g.name) +
           " (dropped from its ring)";
    } else {
      s += "completed nothing in group " + in_quotes(g.name);
    }
    const FrEntry* other = oldest_pending_[d.rank];  // its oldest op pending anywhere
    if (other) {
      s += "; it waits in " + op_text(*other, group_ranks(other->group)) + " (" + state_name(other->state);
      const double ago = seconds_before(d, other->time_started_ns ? other->time_started_ns : other->time_created_ns);
      s += (ago >= 0 ? ", " + secs(ago) : std::string()) + ")";
    } else {
      s += "; nothing pending in any group: busy outside tdist (data loader, a loop, a hang elsewhere?)";
    }
    int64_t most = 0;
    for (const auto& [r, other_view] : g.views) most = std::max(most, other_view.dump->steps);
    if (most > d.steps) s += "; " + std::to_string(d.steps) + " steps (others up to " + std::to_string(most) + ")";
    return s;
  }

  const std::vector<int>& group_ranks(const std::string& name) const {
    static const std::vector<int> none;
    const auto it = index_.find(name);
    return it == index_.end() ? none : groups_[it->second].ranks;
  }

  void failed_and_p2p() {
    for (const auto& [r, d] : by_rank_) {
      for (const FrEntry& e : d->entries) {
        if (e.state == FrState::failed) {
          Finding& f = add(FindingKind::failed, e.group, {r},
                           "rank " + std::to_string(r) + ": " + op_text(e, group_ranks(e.group)) +
                               " failed: " + printable(e.error.empty() ? "(no error given)" : e.error, 300));
          f.seq = e.is_p2p ? e.p2p_seq_id : e.collective_seq_id;
          f.op = e.op;
        } else if (e.is_p2p && e.state != FrState::completed) {
          const double ago = seconds_before(*d, e.time_started_ns ? e.time_started_ns : e.time_created_ns);
          Finding& f = add(FindingKind::p2p_pending, e.group, {r},
                           "rank " + std::to_string(r) + ": " + op_text(e, group_ranks(e.group)) + " pending (" +
                               state_name(e.state) + (ago >= 0 ? ", " + secs(ago) : std::string()) + ")");
          f.seq = e.p2p_seq_id;
          f.op = e.op;
          f.waited_s = std::max(ago, 0.0);
        }
      }
    }
  }

  void report() {
    std::string& out = a.report;
    std::set<int> named;  // ranks whose missing dump a line already said
    size_t lines = 0, left = 0;
    for (const Finding& f : a.findings) {
      if (f.kind == FindingKind::missing_dump && named.count(f.ranks[0])) continue;
      for (const int r : f.no_dump) named.insert(r);
      if (lines >= 12) {
        ++left;
        continue;
      }
      out += f.message + "\n";
      ++lines;
      for (size_t i = 0; i < f.details.size() && i < 3; ++i, ++lines) out += "  " + f.details[i] + "\n";
    }
    if (left) out += "... and " + std::to_string(left) + " more findings (--json lists them all)\n";
    std::string summary = std::to_string(a.dumped.size()) + (a.dumped.size() == 1 ? " rank" : " ranks");
    if (static_cast<int>(a.dumped.size()) != a.world_size) summary += " of " + std::to_string(a.world_size);
    summary += ", " + std::to_string(a.groups.size()) + (a.groups.size() == 1 ? " group" : " groups");
    if (a.findings.empty()) {
      summary += ": every collective enqueued was completed on every rank";
      std::string through;
      for (size_t i = 0; i < a.groups.size() && i < 4; ++i) {
        through += (i ? ", group " : "group ") + in_quotes(a.groups[i].name) + " through #" +
                   std::to_string(a.groups[i].completed_through);
      }
      if (a.groups.size() > 4) through += ", ...";
      if (!through.empty()) summary += " (" + through + ")";
    } else {
      summary += ": " + std::to_string(a.findings.size()) + (a.findings.size() == 1 ? " finding" : " findings");
    }
    out += summary + "\n";
  }
};

}  // namespace

Analysis analyze(const std::vector<RankDump>& dumps) { return Analyzer(dumps).run(); }

std::string analysis_json(const Analysis& a) {
  using Json = nlohmann::json;
  Json groups = Json::array();
  for (const GroupSummary& g : a.groups) {
    groups.push_back({{"name", g.name}, {"ranks", g.ranks}, {"completed_through", g.completed_through}});
  }
  Json findings = Json::array();
  for (const Finding& f : a.findings) {
    findings.push_back({{"kind", finding_kind_name(f.kind)},
                        {"group", f.group},
                        {"seq", f.seq},
                        {"op", f.op},
                        {"ranks", f.ranks},
                        {"waiting", f.waiting},
                        {"completed", f.completed},
                        {"no_dump", f.no_dump},
                        {"waited_s", f.waited_s},
                        {"message", f.message},
                        {"details", f.details}});
  }
  const Json out = {{"exit_code", a.exit_code},
                    {"world_size", a.world_size},
                    {"dumped", a.dumped},
                    {"groups", groups},
                    {"findings", findings}};
  return out.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

}  // namespace tdist::trace
