// Seeing what a job does (docs/observability.md).
//
// The flight recorder is on by default: every rank keeps its last
// TDIST_FR_BUFFER_SIZE ops (default 2000; 0 turns it off) of every process
// group, and writes them as JSON to $TDIST_DUMP_DIR/rank-<R>.json (default
// ./tdist-dumps/<job>/) when an op times out, a peer fails, ranks call
// mismatched collectives, on SIGUSR1 (unless the program handles SIGUSR1
// itself), and when tdist-run finds the job stalled. `tdist-trace analyze
// DIR` reads every rank's dump and says who is behind, where, and why.
#pragma once

#include <string>

namespace tdist::trace {

// Writes this rank's flight recorder dump now; returns its path ("" when
// it could not be written: a line on stderr says why; or when the recorder
// is off).
std::string dump_flight_recorder();

// The timeline: Chrome trace events (Perfetto, chrome://tracing) of this
// rank's collectives, waits, FSDP units' forward and backward, checkpoint
// snapshots and writes, and training steps. On from the first group when
// TDIST_TRACE=PATH is set, or from this call (the first path given wins):
// written to PATH.rank-<R>.json ("{rank}" in PATH is replaced instead) at
// exit and by flush_timeline. `tdist-trace merge` puts the ranks on one
// timeline; `tdist-trace summary` prints compute and exposed
// communication per step.
void start_timeline(const std::string& path);
// Writes the timeline so far; its path ("" when it was never started or
// could not be written).
std::string flush_timeline();
// Pauses (false) or resumes (true) a started timeline, e.g. to record a
// few steps of a long run; paused, it costs what it costs off.
void set_timeline_enabled(bool on);

// Pauses (false) or resumes (true) recording: ops queued while paused
// leave no record (the ring keeps what it has; they still take their
// number, Work::seq, so the numbers go on as the errors give them); pause
// every rank at the same point, or tdist-trace analyze sees ops on some
// ranks that others did not record. For measuring what the recorder
// costs (tdist-bench ddp/fsdp's *_nofr variants); it is cheap enough to
// leave on.
void set_flight_recorder_enabled(bool on);

// A training step begins (for tdist-run --status-interval's steps/s).
// DistributedDataParallel's and FullyShardedDataParallel's training
// forwards count themselves; call it from a loop that uses neither.
void mark_step();

}  // namespace tdist::trace
