// FlashFwdKernelFp8: the warp-specialised FP8 forward kernel. The producer warpgroup
// streams Q, K and V with TMA and transposes V in shared memory; two consumer warpgroups
// run the FP8 WGMMAs and the online softmax; O is written in bf16.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/version.h>
#include <cutlass/device_kernel.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "barriers.h"
#include "epilogue_fwd.h"
#include "mainloop_fwd_fp8.h"
#include "scheduler.h"
#include "scheduler_tail.h"
#include "traits_fp8.h"

namespace flash3 {

using namespace cute;

template <class Traits_, class Mask_>
struct FlashFwdKernelFp8 {
  using Traits = Traits_;
  using Mask = Mask_;
  using Mainloop = MainloopFwdFp8<Traits, Mask>;
  using Epilogue = std::conditional_t<Traits::kTmaStoreO || Traits::kOInKVStages, EpilogueFwdTma<typename Traits::OutputTraits>,
                                      EpilogueFwd<Traits, typename Traits::ElementOut>>;
  using ElementOut = typename Traits::ElementOut;
  // The persistent causal kernels deal their last rounds of tiles out on the host
  // (scheduler_tail.h), as the 16-bit short causal kernels do. H200 A/B against the plain
  // snake (three passes, bitwise-identical outputs): hdim 128
  // +1.5..+2.5% and hdim 256 +1.4..+2.3% at 1k-4k keys (+0.2% at 512).
  static constexpr bool kTailBalanced = Traits::kPersistent && Mask::kIsCausal;
  using Scheduler = std::conditional_t<kTailBalanced, TailBalancedScheduler,
                                       TileScheduler</*kPersistent=*/Traits::kPersistent, /*kLongestFirst=*/Mask::kIsCausal>>;
  using PipelineK = typename Traits::PipelineK;
  using PipelineV = typename Traits::PipelineV;
  using PipelineVt = typename Traits::PipelineVt;
  using PipelineState = typename Traits::PipelineState;

  static constexpr int kThreads = Traits::kThreads;
  // One K or V^T stage, in bytes (the stage is the outermost mode of their layouts).
  static constexpr int kStageBytesK = cute::cosize_v<typename Traits::SmemLayoutK> / Traits::kStages;
  static constexpr int kStageBytesVt = cute::cosize_v<typename Traits::SmemLayoutVt> / Traits::kStages;
  static_assert(!Traits::kOInKVStages ||
                    (kStageBytesK >= 64 * Traits::kHeadDim * 2 && kStageBytesVt >= 64 * Traits::kHeadDim * 2 &&
                     kStageBytesK % 1024 == 0 && kStageBytesVt % 1024 == 0 && CUTLASS_MAJOR >= 4),
                "a K or V^T stage holds one warpgroup's 64 rows of O (bf16), 1024-byte aligned; the release after "
                "the store needs CUTLASS 4's arrival counting (kernel_fwd.h)");

  struct NoStorage {};
  struct SharedStorage {
    typename Mainloop::SharedStorage mainloop;
    // O's staging buffer (kTmaStoreO): each warp writes and stores its own 16 rows.
    std::conditional_t<Traits::kTmaStoreO,
                       cute::array_aligned<ElementOut, cute::cosize_v<typename Traits::OutputTraits::SmemLayoutQ>, 1024>,
                       NoStorage>
        smem_o;
    // Q: full when its TMA bytes have landed; empty when both consumer warpgroups have
    // finished their last Q K^T of the tile.
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q_full;
    alignas(16) cutlass::arch::ClusterBarrier barrier_q_empty;
    alignas(16) typename PipelineK::SharedStorage pipeline_k;
    alignas(16) typename PipelineV::SharedStorage pipeline_v;
    alignas(16) typename PipelineVt::SharedStorage pipeline_vt;
  };
  static constexpr int kSharedStorageSize = sizeof(SharedStorage);
  static_assert(kSharedStorageSize <= 227 * 1024, "tile does not fit in shared memory");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
  };

  // Kernel parameters live in a 4 KB constant bank (the scheduler's table is most of them).
  static_assert(sizeof(Params) <= 4096, "kernel parameters exceed 4 KB");

  static Params to_params(FwdFp8Params const& p) {
    int const num_m_blocks = (p.base.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    typename Scheduler::Params scheduler;
    if constexpr (kTailBalanced) {
      scheduler = Scheduler::to_params(num_m_blocks, p.base.nheads, p.base.batch, p.base.num_sms, p.base.seqlen_q,
                                       p.base.seqlen_k, Traits::kBlockM, Traits::kBlockN);
    } else {
      scheduler = Scheduler::to_params(num_m_blocks, p.base.nheads, p.base.batch, p.base.num_sms);
    }
    return {Mainloop::to_params(p), Epilogue::to_params(p.base), scheduler};
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    auto const role = WarpGroupRole(cutlass::canonical_warp_group_idx());
    int const lane_predicate = cute::elect_one_sync();
    bool const is_producer = role == WarpGroupRole::Producer;

    if (warp_idx == 0 && lane_predicate) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      storage.barrier_q_full.init(/*arrive_count=*/1);
      storage.barrier_q_empty.init(/*arrive_count=*/Traits::kConsumerThreads);
      if constexpr (Traits::kTmaStoreO || Traits::kOInKVStages) { Epilogue::prefetch_tma_descriptor(params.epilogue); }
    }

    // K: TMA -> consumers. V: TMA -> the producer warpgroup's transposer. V^T: transposer
    // (every producer thread arrives) -> consumers (every consumer thread releases).
    typename PipelineK::Params params_k;
    params_k.transaction_bytes = Traits::kBytesKV;
    params_k.num_consumers = Traits::kConsumerThreads;
    params_k.role = is_producer ? PipelineK::ThreadCategory::Producer : PipelineK::ThreadCategory::Consumer;
    params_k.is_leader = warp_idx == 0 && lane_predicate;
    PipelineK pipeline_k(storage.pipeline_k, params_k, Shape<_1, _1, _1>{});

    typename PipelineV::Params params_v;
    params_v.transaction_bytes = Traits::kBytesKV;
    params_v.num_consumers = Traits::kProducerThreads;
    params_v.role = is_producer ? PipelineV::ThreadCategory::ProducerConsumer : PipelineV::ThreadCategory::NonParticipant;
    params_v.is_leader = warp_idx == 0 && lane_predicate;
    PipelineV pipeline_v(storage.pipeline_v, params_v, Shape<_1, _1, _1>{});

    typename PipelineVt::Params params_vt;
    params_vt.producer_arv_count = Traits::kProducerThreads;
    params_vt.consumer_arv_count = Traits::kConsumerThreads;
    params_vt.role = is_producer ? PipelineVt::ThreadCategory::Producer : PipelineVt::ThreadCategory::Consumer;
    PipelineVt pipeline_vt(storage.pipeline_vt, params_vt);

    __syncthreads();  // barrier initialisation visible to all before use

    auto const& sched = params.scheduler;
    if (is_producer) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
      bool const tma_thread = warp_idx == 0 && lane_predicate;
      int const thread_idx = int(threadIdx.x);
      // A V stage is read by the transposer in lockstep with the V^T stage it writes, and
      // K and V stages are written one key tile ahead of it: one state serves all three
      // (Mainloop::load; registers: the producer runs on 24 at hdim 256).
      static_assert(PipelineK::Stages == PipelineVt::Stages && PipelineV::Stages == PipelineVt::Stages,
                    "the K/V write state is derived from the transpose state");
      PipelineState transpose = cutlass::make_producer_start_state<PipelineVt>();
      int q_phase = 0;
      for (int t = Scheduler::first_tile(); t < sched.num_tiles; t = Scheduler::next_tile(sched, t)) {
        auto const tile = Scheduler::coord(sched, t);
        if (Mainloop::n_block_end(params.mainloop, tile.m_block) <= 0) { continue; }
        Mainloop::load(params.mainloop, storage.mainloop, storage.barrier_q_full, storage.barrier_q_empty, q_phase,
                       pipeline_k, pipeline_v, pipeline_vt, transpose, tile.m_block,
                       tile.head, tile.batch, tma_thread, thread_idx);
        q_phase ^= 1;
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      PipelineState read_k, read_vt;
      int q_phase = 0;
      for (int t = Scheduler::first_tile(); t < sched.num_tiles; t = Scheduler::next_tile(sched, t)) {
        auto const tile = Scheduler::coord(sched, t);
        bool const has_keys = Mainloop::n_block_end(params.mainloop, tile.m_block) > 0;
        Tensor tOrO = partition_fragment_C(typename Traits::TiledMmaPV{}, select<0, 1>(typename Traits::TileShapePV{}));
        auto lse = Mainloop::mma(params.mainloop, storage.mainloop, storage.barrier_q_full, storage.barrier_q_empty,
                                 q_phase, pipeline_k, pipeline_vt, read_k, read_vt, tOrO, thread_idx, tile.m_block,
                                 tile.head, tile.batch);
        if (has_keys) { q_phase ^= 1; }
        // FP8 batches are dense (seqlen.h).
        Seq const seq{params.mainloop.seqlen_q, params.mainloop.seqlen_k, 0, 0, tile.batch, 0};
        if constexpr (Traits::kOInKVStages) {
          if (has_keys) {
            // The tile's last K and V^T stages (the mainloop left them locked) take the two
            // warpgroups' rows of O once both warpgroups' GEMMs are done with them.
            int const last_k = (read_k.index() + Traits::kStages - 1) % Traits::kStages;
            int const last_vt = (read_vt.index() + Traits::kStages - 1) % Traits::kStages;
            named_barrier_sync(Traits::kConsumerThreads, NamedBarrier::OStaging);
            uint8_t* const staging =
                thread_idx < cutlass::NumThreadsPerWarpGroup
                    ? reinterpret_cast<uint8_t*>(storage.mainloop.smem_vt.data()) + last_vt * kStageBytesVt
                    : reinterpret_cast<uint8_t*>(storage.mainloop.smem_k.data()) + last_k * kStageBytesK;
            Epilogue::store_warpgroup(params.epilogue, reinterpret_cast<ElementOut*>(staging), tOrO, lse, thread_idx,
                                      tile.m_block, tile.head, seq);
            Epilogue::wait_staging_read();
            // UNLOCK the K and V^T stages: O has left them (only their index is read). Each
            // thread arrives after its own warp's stores have read the stage; the stage
            // frees when all consumer threads have arrived (CUTLASS 4; kernel_fwd.h).
            pipeline_k.consumer_release(PipelineState(last_k, 0, 0));
            pipeline_vt.consumer_release(PipelineState(last_vt, 0, 0));
          } else {
            Epilogue::Direct::store(params.epilogue.direct, tOrO, lse, thread_idx, tile.m_block, tile.head, seq);
          }
        } else if constexpr (Traits::kTmaStoreO) {
          Epilogue::wait_staging_read();  // LOCK sO (this warp's rows): its previous store has read them
          Epilogue::store(params.epilogue, storage.smem_o.data(), tOrO, lse, thread_idx, tile.m_block, tile.head,
                          seq);
        } else {
          Epilogue::store(params.epilogue, tOrO, lse, thread_idx, tile.m_block, tile.head, seq);
        }
      }
      // TMA stores read shared memory asynchronously; it must outlive them.
      if constexpr (Traits::kTmaStoreO || Traits::kOInKVStages) { Epilogue::wait_staging_read(); }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    flash_fwd_fp8_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) char smem[];
  Kernel{}(params, smem);
#endif
}

}  // namespace flash3
