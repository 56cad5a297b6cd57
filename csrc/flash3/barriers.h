// Warpgroup roles, named barriers and register budgets of the warp-specialised kernels.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

namespace flash3 {

enum class WarpGroupRole { Producer = 0, Consumer0 = 1, Consumer1 = 2, Consumer2 = 3 };

// Hardware named barriers 0..15. CUTLASS reserves the low ids
// (cutlass::arch::ReservedNamedBarriers) and its NamedBarrier::sync/arrive add
// FirstUserBarrier to the id they are given, so ours count from 0. One entry per event.
enum class NamedBarrier : int {
  // Pingpong: consumer warpgroup i may issue its next GEMMs (the others are in softmax).
  PingpongTurnWG0 = 0,
  PingpongTurnWG1 = 1,
  PingpongTurnWG2 = 2,
  // Backward, hdim 192/256 (lockstep): both halves of P (of dS) of a query tile are in
  // shared memory. (The split-keys kernels use mbarriers for dS, and the turns above.)
  PFull = 3,
  dSFull = 4,
  // Backward: the dQ warp's bulk reduction has read consumer warpgroup i's half of the
  // dQ buffer (kDqViaSmem); DqEmptyWG0 + i.
  DqEmptyWG0 = 5,
  // Backward, dQ over the Q/dO stages (hdim 256): both consumer warpgroups' GEMMs have
  // read the Q stage (warpgroup 0 writes its dQ half over it; dOStageRead below for dO).
  QStageRead = 6,
  DqEmptyWG1 = 7,
  // Backward epilogue (consumers only, after their last query tile, when dSFull is no
  // longer used): K and V are dead, then dK and dV are staged over them. The hardware
  // has no id left, so it shares dSFull's.
  dKVStaging = dSFull,
  // Backward, dQ over the Q/dO stages (hdim 256): both consumer warpgroups' GEMMs have
  // read the dO stage (warpgroup 1 writes its dQ half over it). Those kernels have no dQ
  // buffer, so DqEmptyWG0's id is free there.
  dOStageRead = DqEmptyWG0,
  // Backward, transposed layout (hdim 256, one P and one dS buffer): both consumer
  // warpgroups' GEMMs of the previous query tile are done with the buffers. Those
  // kernels have neither a dQ buffer nor dQ over the stages, so QStageRead's id is free.
  PdSEmpty = QStageRead,
  // Forward (kOInKVStages, traits.h): both consumer warpgroups' last GEMMs of a tile are
  // done, so O may be staged over the tile's last K and V stages. Forward kernels use
  // none of the backward's ids.
  OStaging = PFull,
  // Forward, packed batches with seqused_k: every consumer thread has zeroed its share of
  // the V rows past a sequence's length (mainloop_fwd.h zero_v_tail).
  VTailZeroed = dSFull,
};
static_assert(static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier) + 8 <= 16,
              "named barrier ids run past the 16 the hardware has");

CUTLASS_DEVICE NamedBarrier dq_empty_barrier(int warpgroup) {
  return warpgroup == 0 ? NamedBarrier::DqEmptyWG0 : NamedBarrier::DqEmptyWG1;
}

CUTLASS_DEVICE NamedBarrier pingpong_turn_barrier(int warpgroup) {
  return static_cast<NamedBarrier>(static_cast<int>(NamedBarrier::PingpongTurnWG0) + warpgroup);
}

CUTLASS_DEVICE void named_barrier_sync(int num_threads, NamedBarrier id) {
  cutlass::arch::NamedBarrier::sync(num_threads, static_cast<int>(id));
}
CUTLASS_DEVICE void named_barrier_arrive(int num_threads, NamedBarrier id) {
  cutlass::arch::NamedBarrier::arrive(num_threads, static_cast<int>(id));
}

// Pingpong between consumer warpgroups (the forward, 16-bit and FP8, and the backward):
// a warpgroup waits for its turn before issuing its GEMMs and passes the turn on right
// after, so one warpgroup's GEMMs overlap the other's softmax. Every warpgroup issues the
// same number of times per tile; the last warpgroup's final hand-over is skipped (its
// first turn came from start()), which balances the barriers at each tile boundary. No
// counters: the caller says which issue is the final one (registers are tight at hdim
// 256).
//
// kIdsFromThreadIdx (two consumer warpgroups, which are threads 128..255 and 256..383 of
// the CTA): each turn reads %tid.x afresh and picks its barrier id by a predicate, so the
// ids are immediates and no register holds them across the key loop. The FP8 hdim 256
// kernels (240 registers per consumer thread for O, S and P) kept the two ids in local
// memory otherwise, one load ahead of each turn.
template <int kWarpgroups, bool kEnabled, bool kIdsFromThreadIdx = false>
struct PingpongTurns {
  static constexpr int kBarrierThreads = 2 * cutlass::NumThreadsPerWarpGroup;
  static_assert(!kIdsFromThreadIdx || kWarpgroups == 2, "ids from %tid.x: two consumer warpgroups");
  // Hardware ids of warpgroup 0's and 1's turns (CUTLASS's NamedBarrier adds the offset).
  static constexpr int kHardwareId0 =
      static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier) +
      static_cast<int>(NamedBarrier::PingpongTurnWG0);
  static_assert(static_cast<int>(NamedBarrier::PingpongTurnWG1) == static_cast<int>(NamedBarrier::PingpongTurnWG0) + 1);
  int warpgroup;

  // Only for a tile with at least one key tile.
  CUTLASS_DEVICE void start() const {
    if constexpr (kEnabled) {
      if (warpgroup == kWarpgroups - 1) { named_barrier_arrive(kBarrierThreads, pingpong_turn_barrier(0)); }
    }
  }
  CUTLASS_DEVICE void wait_turn() const {
    if constexpr (kEnabled && kIdsFromThreadIdx) {
      asm volatile(  // LOCK: warpgroup 1 (tid >= 256) waits on id 1, warpgroup 0 on id 0
          "{\n .reg .u32 t;\n .reg .pred p;\n mov.u32 t, %%tid.x;\n setp.ge.u32 p, t, 256;\n"
          " @p bar.sync %1, %0;\n @!p bar.sync %2, %0;\n}\n"
          :
          : "n"(kBarrierThreads), "n"(kHardwareId0 + 1), "n"(kHardwareId0)
          : "memory");
    } else if constexpr (kEnabled) {
      named_barrier_sync(kBarrierThreads, pingpong_turn_barrier(warpgroup));  // LOCK
    }
  }
  template <bool kFinalIssue>
  CUTLASS_DEVICE void pass_turn() const { pass_turn(kFinalIssue); }
  CUTLASS_DEVICE void pass_turn(bool final_issue) const {
    if constexpr (kEnabled) {
      if (!(final_issue && warpgroup == kWarpgroups - 1)) {
        if constexpr (kIdsFromThreadIdx) {
          asm volatile(  // UNLOCK: warpgroup 1 passes to id 0, warpgroup 0 to id 1
              "{\n .reg .u32 t;\n .reg .pred p;\n mov.u32 t, %%tid.x;\n setp.ge.u32 p, t, 256;\n"
              " @p bar.arrive %2, %0;\n @!p bar.arrive %1, %0;\n}\n"
              :
              : "n"(kBarrierThreads), "n"(kHardwareId0 + 1), "n"(kHardwareId0)
              : "memory");
        } else {
          named_barrier_arrive(kBarrierThreads, pingpong_turn_barrier((warpgroup + 1) % kWarpgroups));  // UNLOCK
        }
      }
    }
  }
};

// Register budget per thread, per role, for setmaxnreg. A CTA of W warpgroups with one
// block per SM launches with 65536 / (W * 128) registers per thread, rounded down to 8
// (the allocation granularity), and setmaxnreg moves them between warpgroups within that
// pool. The producer only issues TMA (and, in the backward, bulk-reduces dQ) and needs
// few; the rest is split between the consumers, in multiples of 8.
//   W = 3: 168 per thread, 504 per warpgroup-slot; producer 24 (FlashAttention-3 and
//          CUTLASS use 24-40); consumers (504 - 24) / 2 = 240. (A producer at 32 would
//          leave the consumers 232, which the backward measured in spills.)
//   W = 4: 128 per thread, 512 per slot; consumers (512 - 24) / 3 = 162 -> 160.
// The FP8 forward's producer also transposes V and takes 40 where its consumers can spare
// them (traits_fp8.h): consumers 232 (W = 3) or 152 (W = 4).
template <int kConsumerWarpgroups, int kProducerRegisters = 24>
struct RegisterBudget {
  static constexpr int kWarpgroups = kConsumerWarpgroups + 1;
  static constexpr int kPerSlot = 65536 / (kWarpgroups * 128) / 8 * 8 * kWarpgroups;
  static constexpr int kProducer = kProducerRegisters;
  static constexpr int kConsumer = ((kPerSlot - kProducer) / kConsumerWarpgroups) / 8 * 8;
  static_assert(kProducer % 8 == 0 && kProducer >= 24, "setmaxnreg takes multiples of 8, at least 24");
  static_assert(kConsumer <= 256, "setmaxnreg takes at most 256 registers");
  static_assert(kProducer * 128 + kConsumer * 128 * kConsumerWarpgroups <= 65536, "register file over-subscribed");
};

}  // namespace flash3
