// The backward's dQ warp: each query tile's dQ halves, from shared memory into the float32
// workspace with bulk reductions, in a fixed order in deterministic mode (MainloopBwd::store_dq).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "mainloop_bwd.h"

namespace flash3 {

using namespace cute;

CUTLASS_DEVICE int cuda_ld_acquire(int const* ptr) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}
CUTLASS_DEVICE void cuda_st_release(int* ptr, int value) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// The dQ warp (one warp of the producer warpgroup): per query tile, waits for each
// consumer warpgroup's half of dQ in shared memory and adds it to the workspace tile
// with a bulk reduction issued by one lane. Deterministic mode takes turns per query
// tile so that the float32 sums happen in a fixed order: the key tiles that see query tile m are
// 0..n_last(m), and they add in descending order (n_last first), each waiting until the
// semaphore counts the tiles above it. Descending, because a key tile walks its query
// tiles upwards from the first that sees it: tile n + 1 starts at a later query tile
// and so reaches every shared one a step or more ahead of tile n, and under the causal
// mask nobody waits in the steady state. (Ascending order made every key tile trail
// tile 0, which sees all query tiles: causal backward ran 1.6x slower.) The grid
// launches higher key tiles first (kernel_bwd.h), so the one waited for is running or
// done.
template <class Traits, class Mask>
CUTLASS_DEVICE void MainloopBwd<Traits, Mask>::store_dq(Params const& params, SharedStorage& storage, int n_block, int head,
                                    Seq const& seq) {
  // Lean on registers: this warp runs with the producer's 24, and one lane does the work.
  int const m_begin = m_block_begin(params, seq, n_block);
  int const m_end = m_block_end(params, seq, n_block);
  int const lane = threadIdx.x % cutlass::NumThreadsPerWarp;
  int64_t const head_tile0 = (int64_t(seq.batch) * params.nheads + head) * params.dq_m_blocks + seq.offset_q_padded / kBlockM;
  constexpr uint32_t kHalfBytes = Traits::kDqElements / 2 * sizeof(float);
  CUTLASS_PRAGMA_NO_UNROLL
  for (int m_block = m_begin; m_block < m_end; ++m_block) {
    int const stage = (m_block - m_begin) % Traits::kStages;
    uint32_t const phase = ((m_block - m_begin) / Traits::kStages) & 1;
    // Where the consumer warpgroups put their halves (hand_over_dq()).
    float const* halves[2] = {
        Traits::kDqViaSmem ? storage.smem_dq.data()
                           : reinterpret_cast<float const*>(storage.smem_q.data() + stage * kStageElements),
        Traits::kDqViaSmem ? storage.smem_dq.data() + Traits::kDqElements / 2
                           : reinterpret_cast<float const*>(storage.smem_do.data() + stage * kStageElements)};
    float* dq_tile = params.dq_accum + (head_tile0 + m_block) * Traits::kDqElements;
    int* semaphore = params.dq_semaphore != nullptr ? params.dq_semaphore + head_tile0 + m_block : nullptr;
    int turn = 0;  // deterministic: how many key tiles add to this query tile before this one
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      int const half = i ^ kFirstHalf;
      storage.barrier_dq_full[stage][half].wait(phase);  // LOCK sdQ half
      if (lane == 0) {
        if (i == 0 && semaphore != nullptr) {
          turn = n_block_last(params, seq, m_block) - n_block;
          while (cuda_ld_acquire(semaphore) != turn) {}
          // Order the acquire before the (async-proxy) reductions below.
          asm volatile("fence.proxy.async.global;" ::: "memory");
        }
        bulk_reduce_add(dq_tile + half * (Traits::kDqElements / 2), halves[half], kHalfBytes);
        cute::tma_store_arrive();  // one bulk group per half
      }
    }
    if (lane == 0) {
      if (semaphore != nullptr) {
        // Deterministic: the next key tile may add only once this tile's sums are done.
        // (Handing the buffers back before that, as soon as they are read, measured
        // 4-14% slower at 1k-16k non-causal, though up to 6% faster causal.)
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        asm volatile("fence.proxy.async.global;" ::: "memory");
        __threadfence();
        cuda_st_release(semaphore, turn + 1);
      } else {
        cute::tma_store_wait<1>();  // the first half has been read
      }
    }
    __syncwarp();
    if constexpr (Traits::kDqViaSmem) {
      // Each warpgroup waits for its half's read only before writing the next tile's.
      bool const more = m_block + 1 < m_end;
      if (more) { named_barrier_arrive(kDqBarrierThreads, NamedBarrier::DqEmptyWG0); }  // UNLOCK sdQ half 0
      if (lane == 0) { cute::tma_store_wait<0>(); }  // half 1 has been read
      __syncwarp();
      if (more) { named_barrier_arrive(kDqBarrierThreads, NamedBarrier::DqEmptyWG1); }  // UNLOCK sdQ half 1
    } else {
      // The producer waits for these before refilling the stages: the dO stage once
      // half 1, the first reduced, has been read (tma_store_wait<1> above, or the whole
      // wait_group in deterministic mode), the Q stage once half 0 has.
      if (lane == 0) {
        release_dq_read(storage, stage, 1);  // UNLOCK dO stage
        cute::tma_store_wait<0>();
        release_dq_read(storage, stage, 0);  // UNLOCK Q stage
      }
    }
  }
  if (lane == 0) { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
}

}  // namespace flash3
