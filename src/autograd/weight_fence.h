// Weight fences: what must finish before a model's weights change again.
// An asynchronous checkpoint copies the weights and optimizer state after
// the save call returns, on its writer thread, while the next forward and
// backward run (they read the weights and change neither); the optimizer's
// step changes them, and it follows the end of the backward. So DDP and
// FSDP call wait_weight_fences() as every backward ends, and a
// Checkpointer with a copy pending holds a fence that finishes it there.
//
// Threading: any thread. wait_weight_fences() costs one atomic load while
// no fence is registered. A fence's function runs on the thread that
// waits, outside the registry's lock, and must not add or remove fences.
#pragma once

#include <cstdint>
#include <functional>

namespace tdist::detail {

// Registers `wait`; returns its id for remove_weight_fence.
uint64_t add_weight_fence(std::function<void()> wait);
// Unregisters it; when this returns, no call of it is running.
void remove_weight_fence(uint64_t id);
// Runs every registered fence.
void wait_weight_fences();

}  // namespace tdist::detail
