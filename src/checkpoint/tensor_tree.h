// LibTorch tensors into and out of tdist's checkpoint trees
// (checkpoint_tree.h has the layout).
//
// Tensors go into a tree through a TensorSink, which hands out storage keys
// and remembers how to produce each tensor when its turn comes to be
// written: so a writer can stream them (one in memory at a time).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint_tree.h"
#include "tdist/state_dict.h"

namespace tdist::checkpoint {

// Host copies of tensors for an asynchronous save, reused from one save to
// the next: a save copies into the buffers of the last one (same dtypes and
// shapes, in the same order), so after the first save a copy costs no page
// faults. One user at a time; restart() before each save's copies, and
// only once the buffers' last writer is done with them.
//
// Deferred copies (set_deferred): copy() of a CPU tensor hands out its
// buffer untouched and notes the copy, cut into 8 MiB chunks; run() and
// finish() make them, from any threads at once, each chunk once (an
// atomic cursor). The tensors copied must not change until finish() has
// returned (the Checkpointer's weight fence: autograd/weight_fence.h).
class CopyPool {
 public:
  // A host copy of t (pinned when t is on a GPU): made now, or, while
  // deferred and for a CPU tensor, by run()/finish().
  at::Tensor copy(const at::Tensor& t);
  void restart();
  // `now`: storages whose tensors are copied at once all the same.
  void set_deferred(bool on, std::vector<const void*> now = {}) {
    deferred_ = on;
    now_ = std::move(now);
  }
  // Makes the deferred copies not yet taken (the writer thread, before it
  // writes).
  void run();
  // run(), then waits for chunks other threads are making: every deferred
  // copy is made when it returns.
  void finish();
  // Whether a deferred copy is not yet made (any thread).
  bool pending() const { return done_.load(std::memory_order_acquire) < chunks_.size(); }

 private:
  struct Chunk {
    const uint8_t* src;
    uint8_t* dst;
    size_t bytes;
  };
  std::vector<at::Tensor> buffers_;
  size_t next_ = 0;
  bool deferred_ = false;
  std::vector<const void*> now_;
  std::vector<at::Tensor> sources_;  // held until the copies are made
  std::vector<Chunk> chunks_;        // set before the copies start; read-only while they run
  std::atomic<size_t> cursor_{0};    // the next chunk to take
  std::atomic<size_t> done_{0};      // chunks made
  std::mutex mu_;
  std::condition_variable all_done_;
};

class TensorSink {
 public:
  using Make = std::function<at::Tensor()>;
  // pool: add(t) keeps a private copy of t from the pool, so that t may
  // change before write (an asynchronous save); null: t itself.
  explicit TensorSink(CopyPool* pool = nullptr) : pool_(pool) {}
  // A tensor value of that dtype and shape whose bytes `make` will produce.
  PtValue add(at::ScalarType dtype, std::vector<int64_t> shape, Make make);
  // A tensor in memory.
  PtValue add(const at::Tensor& t);
  // Writes root (built from this sink's values) and every tensor, in the
  // order root pickles them; finish() is the caller's.
  void write(PtWriter& writer, const PtValue& root);

 private:
  CopyPool* pool_;
  StorageKeys keys_;
  std::vector<std::pair<std::string, Make>> pending_;
};

// Reads a file's tensors with PtReader::read_tensor's checks (the record
// against the file, the view inside it and naming each element once),
// each storage record once: tensors that view one storage (a pickle's memo
// can name one any number of times) share its memory, so together they
// hold at most the file's records. Each tensor is a view of its storage.
// One per reader and load.
class TensorReads {
 public:
  explicit TensorReads(const PtReader& reader) : reader_(reader) {}
  at::Tensor operator()(const PtTensorRef& ref);

 private:
  const PtReader& reader_;
  std::map<std::string, at::Tensor> storages_;
};

PtValue optimizer_value(const OptimizerStateDict& s, TensorSink& sink);
// Everything but the tensors' bytes: the state's tensors are read with
// `read` (given the ref).
OptimizerStateDict optimizer_from(const PtValue& v, const std::function<at::Tensor(const PtTensorRef&)>& read);

}  // namespace tdist::checkpoint
