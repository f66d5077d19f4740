// A Checkpointer directory's names, in one place for the saver
// (checkpointer.cpp) and the tools (tdist-ckpt inspect, tools.cpp):
//
//   DIR/latest                     the marker: the complete checkpoints'
//                                  folders, newest first, one a line
//   DIR/step-NNNNNNNN-<16 hex>/    one save's folder (step, save id)
//
// The marker is written aside and renamed by the Checkpointer, so it is
// always a regular file: it is read never through a symbolic link, never
// waiting on a FIFO, at most kLatestMarkerBytes, and a line that names no
// step folder makes the whole marker bad.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tdist::checkpoint {

inline constexpr const char* kLatestMarker = "latest";
inline constexpr size_t kLatestMarkerBytes = 64 << 10;

struct StepFolder {
  int64_t step = 0;
  std::string name;  // "step-00000100-0123456789abcdef"
};

// "step-<step, 8 digits at least>-<save id, 16 hex digits>".
std::string step_folder_name(int64_t step, uint64_t save_id);
// The folder a name is, or nullopt when it is no step folder's name.
std::optional<StepFolder> parse_step_folder(const std::string& name);

// DIR/latest's folders, newest first; empty when there is no marker.
// CheckpointError ("... the latest marker PATH <why>") when it is not a
// regular file, is too long, or holds a line that names no step folder;
// `who` starts the message ("Checkpointer", "tdist-ckpt inspect").
std::vector<StepFolder> read_latest_marker(const std::string& dir, const std::string& who);

}  // namespace tdist::checkpoint
