#include "tdist/trace.h"

#include "trace/flight_recorder.h"

namespace tdist::trace {

std::string dump_flight_recorder() {
  auto& fr = detail::FlightRecorder::get();
  if (!fr.enabled()) return "";
  return fr.dump(detail::DumpReason::kRequest);
}

void set_flight_recorder_enabled(bool on) { detail::FlightRecorder::get().set_recording(on); }

void mark_step() { detail::FlightRecorder::get().note_step(); }

}  // namespace tdist::trace
