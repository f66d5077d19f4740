#include "tdist/trace.h"

#include "tdist/errors.h"
#include "trace/flight_recorder.h"
#include "trace/timeline.h"

namespace tdist::trace {

std::string dump_flight_recorder() {
  auto& fr = detail::FlightRecorder::get();
  if (!fr.enabled()) return "";
  return fr.dump(detail::DumpReason::kRequest);
}

void set_flight_recorder_enabled(bool on) { detail::FlightRecorder::get().set_recording(on); }

void start_timeline(const std::string& path) {
  if (path.empty()) throw UsageError("start_timeline: the path is empty");
  detail::Timeline::start(path);
}

std::string flush_timeline() {
  detail::Timeline* tl = detail::Timeline::started();
  return tl ? tl->flush() : "";
}

void set_timeline_enabled(bool on) { detail::Timeline::set_paused(!on); }

void mark_step() { detail::FlightRecorder::get().note_step(); }

}  // namespace tdist::trace
