// Typed errors: everything a user of tdist can meet derives from tdist::Error.
//
// Messages carry the context needed to act: the operation, the key or rank,
// how long it waited, and what to do. Broken internal invariants are not
// reported through these types (see src/util/check.h).
#pragma once

#include <stdexcept>
#include <string>

namespace tdist {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A blocking call ran past its timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// The store refused or could not carry out a request (bad state, corrupt
// file, refused authentication, server-side limits).
class StoreError : public Error {
 public:
  using Error::Error;
};

// A socket failed: connection refused, reset or closed by the peer.
class NetworkError : public Error {
 public:
  using Error::Error;
};

// A peer rank died or stopped answering. rank() names it.
class PeerFailureError : public Error {
 public:
  PeerFailureError(const std::string& what, int rank) : Error(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

// Ranks called different collectives, dtypes, sizes or roots at one step.
class CollectiveMismatchError : public Error {
 public:
  using Error::Error;
};

// A checkpoint file cannot be written or read: truncated, corrupt (a
// checksum that does not match), not in the format, from another model or
// world size, a rank missing or given twice. The message names the file.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// The API was misused: bad arguments, bad configuration, wrong call order.
class UsageError : public Error {
 public:
  using Error::Error;
};

}  // namespace tdist
