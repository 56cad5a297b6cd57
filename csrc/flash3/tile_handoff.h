// The hand-over of each tile from a persistent kernel's producer to its consumers, for
// schedules that only the producer knows as it goes (scheduler_packed.h: a packed batch's
// table, whose entries CTAs claim from a device counter).
//
// The producer's thread writes the tile's index into one of two slots and signals the
// slot full; every consumer warp reads it and signals it empty. With two slots the
// producer names the next tile while the consumers still work on the current one, so the
// hand-over is off their path: they wait for it only where the producer itself is late.
// A tile index at or past the scheduler's count ends the walk for both sides.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

namespace flash3 {

template <int kConsumerWarps>
class TileHandoff {
 public:
  static constexpr int kSlots = 2;

  struct SharedStorage {
    alignas(8) cutlass::arch::ClusterBarrier full[kSlots];
    alignas(8) cutlass::arch::ClusterBarrier empty[kSlots];
    int tile[kSlots];
  };

  // Once, by one thread, before the CTA's first __syncthreads.
  CUTLASS_DEVICE static void init(SharedStorage& storage) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kSlots; ++i) {
      storage.full[i].init(/*arrive_count=*/1);
      storage.empty[i].init(/*arrive_count=*/kConsumerWarps);
    }
  }

  // The producer's thread: tile t is the consumers' next.
  CUTLASS_DEVICE void put(SharedStorage& storage, int t) {
    int const slot = position_ % kSlots;
    storage.empty[slot].wait(phase() ^ 1u);  // LOCK: the consumers have read the slot's last tile
    compiler_fence();
    *reinterpret_cast<int volatile*>(&storage.tile[slot]) = t;
    compiler_fence();
    storage.full[slot].arrive();  // UNLOCK: a release, so the consumers' wait sees t
    ++position_;
  }

  // Every thread of the consumer warpgroups: the next tile.
  CUTLASS_DEVICE int take(SharedStorage& storage) {
    int const slot = position_ % kSlots;
    storage.full[slot].wait(phase());  // LOCK: an acquire, t is visible
    compiler_fence();
    int const t = *reinterpret_cast<int const volatile*>(&storage.tile[slot]);
    compiler_fence();
    __syncwarp();  // the warp's lanes have all read it
    if (threadIdx.x % 32 == 0) { storage.empty[slot].arrive(); }  // UNLOCK
    ++position_;
    return t;
  }

 private:
  // The barriers' inline assembly names no memory, so the slot's load and store are
  // pinned around them here.
  CUTLASS_DEVICE static void compiler_fence() { asm volatile("" ::: "memory"); }

  // The parity of the slot's current use.
  CUTLASS_DEVICE uint32_t phase() const { return uint32_t(position_ / kSlots) & 1u; }

  // Tiles put (or taken) so far: one register, as the consumers have none to spare at
  // hdim 256.
  int position_ = 0;
};

}  // namespace flash3
