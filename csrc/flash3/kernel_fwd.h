// FlashFwdKernel: the warp-specialised forward kernel, for 16-bit (traits.h) and e4m3
// (traits_fp8.h) inputs. One producer warpgroup streams Q, K and V tiles into shared
// memory with TMA (and, for e4m3, transposes V); two or three consumer warpgroups, each
// owning 64 rows of the query tile, compute S = Q K^T and O += P V with WGMMA and the
// online softmax in registers.
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
#include "grid_dependency.h"
#include "mainloop_fwd.h"
#include "mainloop_fwd_loads.h"
#include "scheduler.h"
#include "scheduler_packed.h"
#include "scheduler_tail.h"
#include "tile_handoff.h"

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
  // O in the output element type (bf16 for e4m3 inputs): the traits' OutputTraits.
  using ElementOut = typename Traits::ElementOut;
  using Epilogue = std::conditional_t<Traits::kTmaStoreO, EpilogueFwdTma<typename Traits::OutputTraits, kVarlen>,
                                      EpilogueFwd<Traits, ElementOut>>;
  // Equal-length tiles (no mask) are walked by a persistent grid where registers allow;
  // causal tiles of unequal length are left to the hardware's dynamic assignment, except
  // in the persistent causal and local-mask kernels, whose grid walks them in a static
  // balancing order (the snake, or pairs where the host's model finds the snake
  // unbalanced) with its last rounds dealt out on the host, the model counting each
  // tile's keys under the call's window (scheduler.h, scheduler_tail.h, traits.h; the
  // deal measured +1.2..+2.4% at 512-2k tokens, causal, docs/performance.md).
  // Packed batches of unequal lengths walk a table of their real tiles, written on the
  // device (scheduler_packed.h).
  static_assert(Traits::kBlockM >= kPackedMinBlockRows, "the binding sizes the packed-batch tile table by it");
  static constexpr bool kTailBalanced = Traits::kPersistent && kVariableKeys<Mask>;
  using DenseScheduler = std::conditional_t<kTailBalanced, TailBalancedScheduler,
                                            TileScheduler</*kPersistent=*/Traits::kPersistent,
                                                          /*kLongestFirst=*/kVariableKeys<Mask>>>;
  using Scheduler = std::conditional_t<kVarlen, PackedTileScheduler<DenseScheduler, Traits::kPersistent>,
                                       DenseScheduler>;
  // Where only the producer knows the tiles as it goes (a persistent kernel's walk over a
  // packed batch's table, claimed entry by entry), it hands each one to the consumers
  // (tile_handoff.h). Without the table the order is static and each side walks it.
  static constexpr bool kTileHandoff = kVarlen && Traits::kPersistent;
  static_assert(!kTileHandoff || !Traits::kTransposeV, "the hand-over has one producer thread");
  using Handoff = TileHandoff<Traits::kConsumerThreads / cutlass::NumThreadsPerWarp>;
  using Pipelines = typename Mainloop::Pipelines;
  using PipelineState = typename Mainloop::PipelineState;
  using PipelineStateQ = typename Traits::PipelineStateQ;
  static constexpr int kQStages = Traits::kQStages;
  using Registers = typename Traits::Registers;

  static constexpr int kThreads = Traits::kThreads;
  static_assert(!Traits::kOInKVStages ||
                (Traits::kHeadDimV == Traits::kHeadDim &&
                 Mainloop::kStageBytesK >= 64 * Traits::kHeadDimV * int(sizeof(ElementOut)) &&
                 Mainloop::kStageBytesPV >= 64 * Traits::kHeadDimV * int(sizeof(ElementOut)) &&
                 Mainloop::kStageBytesK % 1024 == 0 && Mainloop::kStageBytesPV % 1024 == 0),
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
                       cute::array_aligned<ElementOut, cute::cosize_v<typename Traits::OutputTraits::SmemLayoutO>, 1024>,
                       NoStorage>
        smem_o;
    // Q is loaded once per tile, into buffer (tile count) % kQStages: full when its TMA
    // bytes have landed, empty when all consumer warpgroups have finished their last
    // Q K^T of the tile (every consumer thread arrives), or, where O is staged in Q's
    // buffer, when every consumer warp's TMA store of O has read its rows (one arrival
    // per warp).
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q_full[kQStages];
    alignas(16) cutlass::arch::ClusterBarrier barrier_q_empty[kQStages];
    typename Pipelines::SharedStorage pipelines;
    std::conditional_t<kTileHandoff, typename Handoff::SharedStorage, NoStorage> handoff;
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

  static Params to_params(typename Traits::HostParams const& p) {
    int const num_m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    typename DenseScheduler::Params dense;
    if constexpr (kTailBalanced) {
      // The keys each query tile walks: causal's, or the local mask's window (clamped to the
      // lengths by the binding).
      int left = p.seqlen_k, right = 0;
      if constexpr (Mask::kIsLocal) {
        left = p.window_left;
        right = p.window_right;
      }
      dense = DenseScheduler::to_params(num_m_blocks, p.nheads, p.batch, p.num_sms, p.seqlen_q, p.seqlen_k,
                                        Traits::kBlockM, Traits::kBlockN, left, right);
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
  static cudaError_t prepare(typename Traits::HostParams const& p, cudaStream_t stream) {
    if constexpr (kVarlen) {
      if (!Scheduler::uses_table(p, Traits::kBlockM)) { return cudaSuccess; }
      PackedTileArgs const args{p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, p.split_keys, p.batch, p.nheads,
                                Traits::kBlockM, /*last_first=*/kVariableKeys<Mask>,
                                Traits::kPersistent || !kVariableKeys<Mask> ? 0 : p.num_sms,
                                reinterpret_cast<PackedTileEntry*>(p.packed_tiles),
                                packed_tile_entries(p, Traits::kBlockM),
                                Traits::kPersistent ? packed_tile_counter(p) : nullptr};
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

  // Where O is staged for the TMA store: its own buffer, or Q's (16-bit inputs only).
  CUTLASS_DEVICE static ElementOut* o_staging(SharedStorage& storage) {
    if constexpr (Traits::kSmemOSeparate) {
      return storage.smem_o.data();
    } else {
      static_assert(std::is_same_v<ElementOut, typename Traits::Element>, "O is staged in Q's buffer");
      return storage.mainloop.smem_q.data();
    }
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    auto const role = WarpGroupRole(warp_group_idx);
    int const lane_predicate = cute::elect_one_sync();

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
      if constexpr (kTileHandoff) { Handoff::init(storage.handoff); }
    }

    Pipelines pipelines(storage.pipelines, role == WarpGroupRole::Producer, warp_idx == 0 && lane_predicate);

    // Packed batches start while the kernel before them ends (launch_fwd.h): up to here
    // nothing read global memory; what that kernel wrote (the tile table and its counter,
    // the KV cache's packed queries and split layout) is read from here on
    // (grid_dependency.h).
    if constexpr (kVarlen) {
      wait_for_prior_grids();
      if (warp_idx == 0 && lane_predicate && params.scheduler.tiles != nullptr) {
        packed_tile_prefetch(params.scheduler.tiles, int(blockIdx.x));  // the first tile's entry
      }
    }

    // Barrier and pipeline initialisation must be visible to every thread before use.
    __syncthreads();

    auto const& sched = params.scheduler;
    if (role == WarpGroupRole::Producer) {
      cutlass::arch::warpgroup_reg_dealloc<Registers::kProducer>();
      bool const tma_thread = warp_idx == 0 && lane_predicate;
      // The elected thread issues the loads; with kTransposeV the whole warpgroup runs the
      // loop and transposes V.
      if (Traits::kTransposeV || tma_thread) {
        typename Mainloop::ProducerState write;
        PipelineStateQ write_q;  // advances with every tile that loads Q
        Handoff handoff;  // (kTileHandoff)
        auto const handed = [&](int t) {
          if constexpr (kTileHandoff) {
            if (sched.tiles != nullptr) {
              handoff.put(storage.handoff, t);
              // The CTA's loads are all issued: the next kernel may be scheduled (the
              // consumers cannot tell their last tile here; the first trigger of a CTA counts).
              if (t >= sched.num_tiles) { allow_dependent_grids(); }
            }
          }
          return t;
        };
        for (int t = handed(Scheduler::first_tile(sched)); t < sched.num_tiles;
             t = handed(Scheduler::next_tile(sched, t))) {
          auto const tile = Scheduler::coord(sched, t);
          Seq const seq = seq_at(params, t, tile.batch);
          // Tiles past the sequence's rows (packed batches: the grid covers the longest
          // sequence) and tiles that see no key load nothing.
          if ((kVarlen && tile.m_block * Traits::kBlockM >= seq.seqlen_q) || !Mainloop::has_keys(params.mainloop, seq, tile.m_block)) {
            continue;
          }
          Mainloop::load(params.mainloop, storage.mainloop, storage.barrier_q_full[write_q.index()],
                         storage.barrier_q_empty[write_q.index()], write_q.phase(), write_q.index(), pipelines, write,
                         tile.m_block, tile.head, seq, tma_thread, int(threadIdx.x));
          ++write_q;
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Registers::kConsumer>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      PipelineState read_k, read_v;
      PipelineStateQ read_q;  // the Q buffer of the current tile
      Handoff handoff;  // (kTileHandoff)
      // Whether the producer hands the tiles over, read from the parameters at each use
      // rather than kept in a register (none to spare at hdim 256).
      auto const handed_tiles = [&]() {
        if constexpr (kTileHandoff) {
          return sched.tiles != nullptr;
        } else {
          return false;
        }
      };
      auto const first_tile = [&]() {
        if constexpr (kTileHandoff) {
          if (handed_tiles()) { return handoff.take(storage.handoff); }
        }
        return Scheduler::first_tile(sched);
      };
      auto const next_tile = [&](int t) {
        if constexpr (kTileHandoff) {
          if (handed_tiles()) { return handoff.take(storage.handoff); }
        }
        return Scheduler::next_tile(sched, t);
      };
      for (int t = first_tile(); t < sched.num_tiles; t = next_tile(t)) {
        auto const tile = Scheduler::coord(sched, t);
        Seq seq = seq_at(params, t, tile.batch);
        // Packed batches: no rows, nothing to write. (Not tested in dense kernels, where it
        // never holds: the hdim 64 non-causal kernel spilled for it.)
        if (kVarlen && tile.m_block * Traits::kBlockM >= seq.seqlen_q) { continue; }
        bool const has_keys = Mainloop::has_keys(params.mainloop, seq, tile.m_block);
        // The CTA's last tile (handed tiles: the producer knows it, and triggers). Decided
        // here, before O's registers are live.
        bool const last_tile = kVarlen && !handed_tiles() && Scheduler::next_tile(sched, t) >= sched.num_tiles;
        Tensor tOrO = partition_fragment_C(typename Traits::TiledMmaPV{}, select<0, 1>(typename Traits::TileShapePV{}));
        auto lse = Mainloop::mma(params.mainloop, storage.mainloop, storage.barrier_q_full[read_q.index()],
                                 storage.barrier_q_empty[read_q.index()], read_q.phase(), read_q.index(), pipelines.k,
                                 pipelines.pv(), read_k, read_v, tOrO, thread_idx, tile.m_block, tile.head, seq);
        // A packed batch's sequence read afresh rather than kept in registers across the mainloop.
        if constexpr (kVarlen) {
          seq = seq_at(params, t, tile.batch);
          // After the last tile's GEMMs the next kernel (a KV cache's split merge) may be
          // scheduled, to wait in its prologue for this grid's end.
          if (last_tile) { allow_dependent_grids(); }
        }
        if (has_keys) { ++read_q; }
        if constexpr (Traits::kOInKVStages) {
          if (has_keys) {
            // The tile's last K and V stages (the mainloop left them locked) take the two
            // warpgroups' rows of O once both warpgroups' GEMMs are done with them.
            int const last_k = (read_k.index() + Traits::kStages - 1) % Traits::kStages;
            int const last_v = (read_v.index() + Traits::kStages - 1) % Traits::kStages;
            named_barrier_sync(Traits::kConsumerThreads, NamedBarrier::OStaging);
            int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
            uint8_t* const stage =
                warpgroup == 0
                    ? reinterpret_cast<uint8_t*>(Mainloop::smem_pv(storage.mainloop)) + last_v * Mainloop::kStageBytesPV
                    : reinterpret_cast<uint8_t*>(storage.mainloop.smem_k.data()) + last_k * Mainloop::kStageBytesK;
            ElementOut* const staging = reinterpret_cast<ElementOut*>(stage);
            Epilogue::store_warpgroup(params.epilogue, staging, tOrO, lse, thread_idx, tile.m_block, tile.head,
                                      seq);
            Epilogue::wait_staging_read();
            // UNLOCK the K and V stages: O has left them (only their index is read). Each
            // thread arrives after its own warp's stores have read the stage, and the stage
            // frees only when all 256 have arrived (static_assert above).
            pipelines.k.consumer_release(PipelineState(last_k, 0, 0));
            pipelines.pv().consumer_release(PipelineState(last_v, 0, 0));
          } else {
            Epilogue::Direct::store(params.epilogue.direct, tOrO, lse, thread_idx, tile.m_block, tile.head, seq);
          }
        } else if constexpr (Traits::kTmaStoreO) {
          if (has_keys) {
            ElementOut* const staging = o_staging(storage);
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
