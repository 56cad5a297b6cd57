// FlashFwdKernel: the warp-specialised forward kernel. One producer warpgroup streams
// Q, K and V tiles into shared memory with TMA; two consumer warpgroups, each owning 64
// rows of the query tile, compute S = Q K^T and O += P V with WGMMA and the online
// softmax in registers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/device_kernel.h>
#include <cutlass/cutlass.h>
#include <cutlass/version.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "barriers.h"
#include "epilogue_fwd.h"
#include "mainloop_fwd.h"
#include "scheduler.h"
#include "scheduler_packed.h"
#include "scheduler_tail.h"
#include "traits.h"

namespace flash3 {

using namespace cute;

// kVarlen: a packed batch of sequences of different lengths (seqlen.h). A kernel of its
// own rather than a run-time property of the dense one: read at run time, the lengths
// take registers that the dense kernels at hdim 256 do not have (they spilled).
template <class Traits_, class Mask_, bool kVarlen_ = false>
struct FlashFwdKernel {
  using Traits = Traits_;
  using Mask = Mask_;
  static constexpr bool kVarlen = kVarlen_;
  using Mainloop = MainloopFwd<Traits, Mask, kVarlen>;
  using Epilogue = std::conditional_t<Traits::kTmaStoreO, EpilogueFwdTma<Traits, kVarlen>, EpilogueFwd<Traits>>;
  using Element = typename Traits::Element;
  // Equal-length tiles (no mask) are walked by a persistent grid where registers allow;
  // causal tiles of unequal length are left to the hardware's dynamic assignment, except
  // in the short-sequence kernels, whose persistent grid walks them in a balancing snake
  // order with its last rounds dealt out on the host (scheduler.h, scheduler_tail.h,
  // traits.h). H200 A/B against the plain snake (three passes,
  // bitwise-identical outputs): causal hdim 64 +1.2..+1.7%, hdim 128 +1.5..+2.4% and
  // hdim 256 +1.6% at 1k (-0.2% at 512) over 512-2k tokens.
  // Packed batches of unequal lengths walk a table of their real tiles, written on the
  // device (scheduler_packed.h).
  static_assert(Traits::kBlockM >= kPackedMinBlockRows, "the binding sizes the packed-batch tile table by it");
  static constexpr bool kTailBalanced = Traits::kPersistent && Mask::kIsCausal;
  using DenseScheduler = std::conditional_t<kTailBalanced, TailBalancedScheduler,
                                            TileScheduler</*kPersistent=*/Traits::kPersistent,
                                                          /*kLongestFirst=*/kVariableKeys<Mask>>>;
  using Scheduler = std::conditional_t<kVarlen, PackedTileScheduler<DenseScheduler, Traits::kPersistent>,
                                       DenseScheduler>;
  using PipelineK = typename Traits::PipelineK;
  using PipelineV = typename Traits::PipelineV;
  using PipelineState = typename Traits::PipelineState;
  using PipelineStateQ = typename Traits::PipelineStateQ;
  static constexpr int kQStages = Traits::kQStages;
  using Registers = RegisterBudget<Traits::kConsumerWarpgroups>;

  static constexpr int kThreads = Traits::kThreads;
  // One K or V stage, in elements (the stage is the outermost mode of their layouts).
  static constexpr int kStageElements = Traits::kBlockN * Traits::kHeadDim;
  static_assert(!Traits::kOInKVStages ||
                (Traits::kHeadDimV == Traits::kHeadDim &&
                 kStageElements * Traits::kStages == cute::cosize_v<typename Traits::SmemLayoutK> &&
                 kStageElements >= 64 * Traits::kHeadDim && (kStageElements * sizeof(Element)) % 1024 == 0),
                "a K or V stage (of equal head dims) holds one warpgroup's 64 rows of O, 1024-byte aligned");
  // kOInKVStages releases a K or V stage from every consumer thread once its own warp's
  // TMA stores have read it; that frees the stage only after all warps' stores if the
  // pipeline counts every consumer thread's arrival, as CUTLASS 4's PipelineTmaAsync does
  // in a one-CTA cluster (older releases counted one signalling thread per warpgroup).
  static_assert(!Traits::kOInKVStages || CUTLASS_MAJOR >= 4,
                "kOInKVStages needs CUTLASS 4's PipelineTmaAsync arrival counting (tested with 4.2)");

  struct NoStorage {};
  struct SharedStorage {
    typename Mainloop::SharedStorage mainloop;
    // O's staging buffer, where it is not Q's (traits.h).
    std::conditional_t<Traits::kSmemOSeparate,
                       cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutO>, 1024>, NoStorage>
        smem_o;
    // Q is loaded once per tile, into buffer (tile count) % kQStages: full when its TMA
    // bytes have landed, empty when all consumer warpgroups have finished their last
    // Q K^T of the tile (every consumer thread arrives), or, where O is staged in Q's
    // buffer, when every consumer warp's TMA store of O has read its rows (one arrival
    // per warp).
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q_full[kQStages];
    alignas(16) cutlass::arch::ClusterBarrier barrier_q_empty[kQStages];
    alignas(16) typename PipelineK::SharedStorage pipeline_k;
    alignas(16) typename PipelineV::SharedStorage pipeline_v;
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

  static Params to_params(FwdParams const& p) {
    int const num_m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    typename DenseScheduler::Params dense;
    if constexpr (kTailBalanced) {
      dense = DenseScheduler::to_params(num_m_blocks, p.nheads, p.batch, p.num_sms, p.seqlen_q, p.seqlen_k,
                                        Traits::kBlockM, Traits::kBlockN);
    } else {
      dense = DenseScheduler::to_params(num_m_blocks, p.nheads, p.batch, p.num_sms);
    }
    if constexpr (kVarlen) {
      return {Mainloop::to_params(p), Epilogue::to_params(p), Scheduler::to_params(p, Traits::kBlockM, dense)};
    } else {
      return {Mainloop::to_params(p), Epilogue::to_params(p), dense};
    }
  }

  // Packed batches: the table kernel, before the kernel itself on the same stream.
  static cudaError_t prepare(FwdParams const& p, cudaStream_t stream) {
    if constexpr (kVarlen) {
      if (!Scheduler::uses_table(p, Traits::kBlockM)) { return cudaSuccess; }
      PackedTileArgs const args{p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, p.split_keys, p.batch, p.nheads,
                                Traits::kBlockM, /*last_first=*/kVariableKeys<Mask>,
                                Traits::kPersistent || !kVariableKeys<Mask> ? 0 : p.num_sms,
                                reinterpret_cast<PackedTileEntry*>(p.packed_tiles),
                                packed_tile_entries(p, Traits::kBlockM)};
      return launch_packed_tile_table(args, stream);
    } else {
      return cudaSuccess;
    }
  }

  // Tile t's sequence: a packed batch's from its table entry.
  CUTLASS_DEVICE static Seq seq_at(Params const& params, int t, int batch) {
    if constexpr (kVarlen) {
      return Scheduler::seq(params.scheduler, params.mainloop.seqs, t, batch);
    } else {
      return params.mainloop.seqs.template at<false>(batch);
    }
  }

  CUTLASS_DEVICE static Element* smem_o_of(SharedStorage& storage) {
    if constexpr (Traits::kSmemOSeparate) { return storage.smem_o.data(); } else { return nullptr; }
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    auto const role = WarpGroupRole(warp_group_idx);
    int const lane_predicate = cute::elect_one_sync();

    if constexpr (kVarlen) {
      if (warp_idx == 0 && lane_predicate && params.scheduler.tiles != nullptr) {
        packed_tile_prefetch(params.scheduler.tiles, Scheduler::first_tile());
      }
    }
    if (warp_idx == 0 && lane_predicate) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kQStages; ++q) {
        storage.barrier_q_full[q].init(/*arrive_count=*/1);
        storage.barrier_q_empty[q].init(/*arrive_count=*/Traits::kReleaseQAfterEpilogue
                                            ? Traits::kConsumerThreads / cutlass::NumThreadsPerWarp
                                            : Traits::kConsumerThreads);
      }
      if constexpr (Traits::kTmaStoreO) { Epilogue::prefetch_tma_descriptor(params.epilogue); }
    }

    // The producer warp's elected thread arrives with the transaction bytes; every
    // consumer thread releases a stage, and (CUTLASS 4, one-CTA cluster) the pipeline
    // counts every consumer thread's arrival.
    typename PipelineK::Params pipeline_params;
    pipeline_params.transaction_bytes = Traits::kBytesK;
    pipeline_params.num_consumers = Traits::kConsumerThreads;
    if (role == WarpGroupRole::Producer) {
      pipeline_params.role = PipelineK::ThreadCategory::Producer;
      pipeline_params.is_leader = warp_idx == 0 && lane_predicate;
    } else {
      pipeline_params.role = PipelineK::ThreadCategory::Consumer;
      pipeline_params.is_leader = 0;
    }
    PipelineK pipeline_k(storage.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
    pipeline_params.transaction_bytes = Traits::kBytesV;
    PipelineV pipeline_v(storage.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});

    // Barrier and pipeline initialisation must be visible to every thread before use.
    __syncthreads();

    auto const& sched = params.scheduler;
    if (role == WarpGroupRole::Producer) {
      cutlass::arch::warpgroup_reg_dealloc<Registers::kProducer>();
      if (warp_idx == 0 && lane_predicate) {
        PipelineState write_k = cutlass::make_producer_start_state<PipelineK>();
        PipelineState write_v = cutlass::make_producer_start_state<PipelineV>();
        PipelineStateQ write_q;  // advances with every tile that loads Q
        for (int t = Scheduler::first_tile(); t < sched.num_tiles; t = Scheduler::next_tile(sched, t)) {
          auto const tile = Scheduler::coord(sched, t);
          Seq const seq = seq_at(params, t, tile.batch);
          // Tiles past the sequence's rows (packed batches: the grid covers the longest
          // sequence) and tiles that see no key load nothing.
          if ((kVarlen && tile.m_block * Traits::kBlockM >= seq.seqlen_q) || !Mainloop::has_keys(params.mainloop, seq, tile.m_block)) {
            continue;
          }
          Mainloop::load(params.mainloop, storage.mainloop, storage.barrier_q_full[write_q.index()],
                         storage.barrier_q_empty[write_q.index()], write_q.phase(), write_q.index(), pipeline_k,
                         pipeline_v, write_k, write_v, tile.m_block, tile.head, seq);
          ++write_q;
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Registers::kConsumer>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      PipelineState read_k, read_v;
      PipelineStateQ read_q;  // the Q buffer of the current tile
      for (int t = Scheduler::first_tile(); t < sched.num_tiles; t = Scheduler::next_tile(sched, t)) {
        auto const tile = Scheduler::coord(sched, t);
        Seq seq = seq_at(params, t, tile.batch);
        // Packed batches: no rows, nothing to write. (Not tested in dense kernels, where it
        // never holds: the hdim 64 non-causal kernel spilled for it.)
        if (kVarlen && tile.m_block * Traits::kBlockM >= seq.seqlen_q) { continue; }
        bool const has_keys = Mainloop::has_keys(params.mainloop, seq, tile.m_block);
        Tensor tOrO = partition_fragment_C(typename Traits::TiledMmaPV{}, select<0, 1>(typename Traits::TileShapePV{}));
        auto lse = Mainloop::mma(params.mainloop, storage.mainloop, storage.barrier_q_full[read_q.index()],
                                 storage.barrier_q_empty[read_q.index()], read_q.phase(), read_q.index(), pipeline_k,
                                 pipeline_v, read_k, read_v, tOrO, thread_idx, tile.m_block, tile.head, seq);
        // A packed batch's sequence read afresh rather than kept in registers across the mainloop.
        if constexpr (kVarlen) { seq = seq_at(params, t, tile.batch); }
        if (has_keys) { ++read_q; }
        if constexpr (Traits::kOInKVStages) {
          if (has_keys) {
            // The tile's last K and V stages (the mainloop left them locked) take the two
            // warpgroups' rows of O once both warpgroups' GEMMs are done with them.
            int const last_k = (read_k.index() + Traits::kStages - 1) % Traits::kStages;
            int const last_v = (read_v.index() + Traits::kStages - 1) % Traits::kStages;
            named_barrier_sync(Traits::kConsumerThreads, NamedBarrier::OStaging);
            int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
            Element* staging = warpgroup == 0 ? storage.mainloop.smem_v.data() + last_v * kStageElements
                                              : storage.mainloop.smem_k.data() + last_k * kStageElements;
            Epilogue::store_warpgroup(params.epilogue, staging, tOrO, lse, thread_idx, tile.m_block, tile.head,
                                      seq);
            Epilogue::wait_staging_read();
            // UNLOCK the K and V stages: O has left them (only their index is read). Each
            // thread arrives after its own warp's stores have read the stage, and the stage
            // frees only when all 256 have arrived (static_assert above).
            pipeline_k.consumer_release(PipelineState(last_k, 0, 0));
            pipeline_v.consumer_release(PipelineState(last_v, 0, 0));
          } else {
            Epilogue::Direct::store(params.epilogue.direct, tOrO, lse, thread_idx, tile.m_block, tile.head, seq);
          }
        } else if constexpr (Traits::kTmaStoreO) {
          if (has_keys) {
            Element* staging = Traits::kSmemOSeparate ? smem_o_of(storage) : storage.mainloop.smem_q.data();
            if constexpr (Traits::kSmemOSeparate) { Epilogue::wait_staging_read(); }  // LOCK sO (this warp's rows)
            Epilogue::store(params.epilogue, staging, tOrO, lse, thread_idx, tile.m_block, tile.head, seq);
            if constexpr (Traits::kReleaseQAfterEpilogue) {
              Epilogue::wait_staging_read();
              static_assert(kQStages == 1, "O is staged in the only Q buffer");
              if (thread_idx % cutlass::NumThreadsPerWarp == 0) { storage.barrier_q_empty[0].arrive(); }  // UNLOCK sQ: O has left it
            }
          } else {
            // No key, no Q: the producer skipped this tile, so sQ may already hold the
            // next tile's Q. The zeros go straight from registers.
            Epilogue::Direct::store(params.epilogue.direct, tOrO, lse, thread_idx, tile.m_block, tile.head, seq);
          }
        } else {
          // The thread index read afresh: the rows and addresses derived from it are then
          // computed here rather than kept live (or spilled) across the mainloop.
          int const epilogue_thread_idx = int(reread_thread_idx_x()) - cutlass::NumThreadsPerWarpGroup;
          Epilogue::store(params.epilogue, tOrO, lse, epilogue_thread_idx, tile.m_block, tile.head, seq);
        }
      }
      // TMA stores read shared memory asynchronously; it must outlive them.
      if constexpr (Traits::kTmaStoreO) { Epilogue::wait_staging_read(); }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    flash_fwd_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) char smem[];
  Kernel{}(params, smem);
#endif
}

}  // namespace flash3
