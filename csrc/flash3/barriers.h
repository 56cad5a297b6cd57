// Warpgroup roles, named barriers and register budgets of the warp-specialised kernels.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

namespace flash3 {

enum class WarpGroupRole { Producer = 0, Consumer0 = 1, Consumer1 = 2 };

// Hardware named barriers 0..15; CUTLASS reserves the low ids (cutlass::arch::
// ReservedNamedBarriers), so ours start at FirstUserBarrier. One entry per event.
enum class NamedBarrier : int {
  // Both consumer warpgroups have finished reading sQ: the epilogue may reuse it.
  QueryTileConsumed = static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier),
  // Pingpong: warpgroup 0 / 1 may issue its next GEMMs (the other one is in softmax).
  WarpSchedulerWG0,
  WarpSchedulerWG1,
};

CUTLASS_DEVICE void named_barrier_sync(int num_threads, NamedBarrier id) {
  cutlass::arch::NamedBarrier::sync(num_threads, static_cast<int>(id));
}
CUTLASS_DEVICE void named_barrier_arrive(int num_threads, NamedBarrier id) {
  cutlass::arch::NamedBarrier::arrive(num_threads, static_cast<int>(id));
}

// Register budget per thread, per role, for setmaxnreg. A CTA of W warpgroups with one
// block per SM shares 64K registers: 65536 / (W * 128) per thread on average. The
// producer only issues TMA and needs few; the rest is split between the consumers, in
// multiples of 8 (setmaxnreg's granularity).
//   W = 3: 512 per warpgroup-slot; producer 24 (FlashAttention-3 and CUTLASS use 24-40),
//          consumers (512 - 24) / 2 = 244 -> 240.
template <int kConsumerWarpgroups>
struct RegisterBudget {
  static constexpr int kWarpgroups = kConsumerWarpgroups + 1;
  static constexpr int kPerSlot = 65536 / (kWarpgroups * 128) * kWarpgroups;
  static constexpr int kProducer = 24;
  static constexpr int kConsumer = ((kPerSlot - kProducer) / kConsumerWarpgroups) / 8 * 8;
  static_assert(kConsumer <= 256, "setmaxnreg takes at most 256 registers");
};

}  // namespace flash3
