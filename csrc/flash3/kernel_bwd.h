// FlashBwdKernel: the warp-specialised backward kernel. A CTA owns one key tile of one
// head: the producer warpgroup's first warp loads its K and V once, then streams the
// query tiles that see it (Q with its lse, dO with its dPsum) through two TMA pipelines;
// the two consumer warpgroups compute S, dP, P, dS and accumulate dK and dV in registers;
// each query tile's dQ goes to a float32 workspace, added by the producer warpgroup's
// second warp (a bulk reduction from shared memory) or by the consumers (atomics).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/device_kernel.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "barriers.h"
#include "dq_writer_bwd.h"
#include "epilogue_bwd.h"
#include "mainloop_bwd.h"
#include "mainloop_bwd_lockstep.h"
#include "mainloop_bwd_split_keys.h"
#include "mainloop_bwd_transposed.h"
#include "scheduler.h"
#include "traits_bwd.h"

namespace flash3 {

using namespace cute;

template <class Traits_, class Mask_>
struct FlashBwdKernel {
  using Traits = Traits_;
  using Mask = Mask_;
  using Mainloop = MainloopBwd<Traits, Mask>;
  using Epilogue = EpilogueBwd<Traits>;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelinedO = typename Traits::PipelinedO;
  using PipelineState = typename Traits::PipelineState;
  using Registers = RegisterBudget<Traits::kConsumerWarpgroups>;

  static constexpr int kThreads = Traits::kThreads;

  // The kernel's barriers live in the mainloop's storage, so that its size is rounded up
  // to the 1 KB alignment of the tiles only once (hdim 64 has no 1 KB to spare).
  struct SharedStorage {
    typename Mainloop::SharedStorage mainloop;
  };
  static constexpr int kSharedStorageSize = sizeof(SharedStorage);
  static_assert(kSharedStorageSize <= 227 * 1024, "tile does not fit in shared memory");

  // The tile order. Key tile fastest: the key tiles of one head run side by side and
  // share its Q and dO through L2; under the causal mask tile 0 sees every query tile,
  // so the longest go first. Causal tiles (not deterministic) go in sections of heads,
  // longest first across the section (scheduler.h), with a one-dimensional grid.
  struct Order {
    int num_n_blocks;
    int nheads;
    int num_bh;
    int section;  // 0: the grid is (key tile, head, batch)
  };

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    Order order;
  };

  static Order order_of(BwdParams const& p) {
    int const num_n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    int section = 0;
    if (Mask::kIsCausal && !p.deterministic) {
      section = section_size(num_n_blocks, p.num_sms, p.batch * p.nheads);
    }
    return {num_n_blocks, p.nheads, p.batch * p.nheads, section};
  }

  static Params to_params(BwdParams const& p) { return {Mainloop::to_params(p), Epilogue::to_params(p), order_of(p)}; }

  static dim3 grid(BwdParams const& p) {
    Order const order = order_of(p);
    if (order.section > 0) { return dim3(order.num_n_blocks * order.num_bh); }
    return dim3(order.num_n_blocks, p.nheads, p.batch);
  }

  struct TileCoord {
    int n_block;
    int head;
    int batch;
  };

  // Deterministic dQ adds the key tiles' parts of a query tile in descending key-tile
  // order (Mainloop::store_dq), so a key tile waits only for higher ones: they must start
  // first, or a resident CTA could wait for one that cannot be scheduled.
  // (Only causal kernels compile the sectioned branch: at hdim 64 the non-causal loop is at
  // the register limit, and the dead branch made ptxas spill there.)
  CUTLASS_DEVICE static TileCoord tile_of(Params const& params) {
    if constexpr (Mask::kIsCausal) {
      Order const& order = params.order;
      if (order.section > 0) {
        SectionedTile const st = sectioned_tile(int(blockIdx.x), order.num_n_blocks, order.section, order.num_bh);
        return {st.rank, st.bh % order.nheads, st.bh / order.nheads};
      }
    }
    bool const deterministic = params.mainloop.dq_semaphore != nullptr;
    int const n_block = deterministic ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
    return {n_block, int(blockIdx.y), int(blockIdx.z)};
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    auto const role = WarpGroupRole(warp_group_idx);
    int const lane_predicate = cute::elect_one_sync();
    TileCoord const tile = tile_of(params);
    int const n_block = tile.n_block, head = tile.head;
    SeqLayout const& seqs = params.mainloop.seqs;
    // Packed batches: the grid covers the longest sequence's key tiles.
    if (!Mainloop::has_keys(seqs.at(tile.batch), n_block)) { return; }
    // The producer warps (24 registers) get the sequence as compile-time dense or packed
    // (a dense batch's lengths then stay kernel parameters); the consumers read it at run
    // time, and afresh after the mainloop rather than keep it in registers across it.
    auto with_seq = [&](auto&& f) {
      if (seqs.is_varlen()) {
        f(seqs.template at<true>(tile.batch));
      } else {
        f(seqs.template at<false>(tile.batch));
      }
    };

    if (warp_idx == 0 && lane_predicate) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      storage.mainloop.barrier_kv.init(/*arrive_count=*/1);
      for (int stage = 0; stage < Traits::kStages; ++stage) {
        for (int warpgroup = 0; warpgroup < Traits::kConsumerWarpgroups; ++warpgroup) {
          storage.mainloop.barrier_dq_full[stage][warpgroup].init(/*arrive_count=*/cutlass::NumThreadsPerWarpGroup);
        }
        for (int half = 0; half < Mainloop::SharedStorage::kDqReadBarriers; ++half) {
          storage.mainloop.barrier_dq_read[stage][half].init(/*arrive_count=*/1);  // the dQ warp
        }
      }
      for (int buffer = 0; buffer < Traits::kPdSStages; ++buffer) {
        storage.mainloop.barrier_ds_full[buffer].init(/*arrive_count=*/Traits::kConsumerThreads);
      }
    }

    typename PipelineQ::Params pipeline_params;
    pipeline_params.transaction_bytes = Traits::kBytesQ;
    pipeline_params.num_consumers = Traits::kConsumerThreads;
    if (role == WarpGroupRole::Producer) {
      pipeline_params.role = PipelineQ::ThreadCategory::Producer;
      pipeline_params.is_leader = warp_idx == 0 && lane_predicate;
    } else {
      pipeline_params.role = PipelineQ::ThreadCategory::Consumer;
      pipeline_params.is_leader = 0;
    }
    PipelineQ pipeline_q(storage.mainloop.pipeline_q, pipeline_params, Shape<_1, _1, _1>{});
    // dO's stages carry fewer bytes than Q's where V's head dim is the smaller (and may be
    // fewer: Traits::kStagesdO).
    typename PipelinedO::Params pipeline_params_do;
    pipeline_params_do.transaction_bytes = Traits::kBytesdO;
    pipeline_params_do.num_consumers = pipeline_params.num_consumers;
    pipeline_params_do.role = pipeline_params.role == PipelineQ::ThreadCategory::Producer
                                  ? PipelinedO::ThreadCategory::Producer
                                  : PipelinedO::ThreadCategory::Consumer;
    pipeline_params_do.is_leader = pipeline_params.is_leader;
    PipelinedO pipeline_do(storage.mainloop.pipeline_do, pipeline_params_do, Shape<_1, _1, _1>{});

    // Barrier and pipeline initialisation must be visible to every thread before use.
    __syncthreads();

    if (role == WarpGroupRole::Producer) {
      cutlass::arch::warpgroup_reg_dealloc<Registers::kProducer>();
      if (warp_idx == 0 && lane_predicate) {
        PipelineState write_q = cutlass::make_producer_start_state<PipelineQ>();
        typename Traits::PipelineStatedO write_do = cutlass::make_producer_start_state<PipelinedO>();
        with_seq([&](Seq const& seq) {
          Mainloop::load(params.mainloop, storage.mainloop, pipeline_q, pipeline_do, write_q, write_do, n_block, head,
                         seq);
        });
      } else if constexpr (!Traits::kDqAtomics) {
        if (warp_idx == 1) {
          with_seq([&](Seq const& seq) { Mainloop::store_dq(params.mainloop, storage.mainloop, n_block, head, seq); });
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Registers::kConsumer>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      PipelineState read_q;
      typename Traits::PipelineStatedO read_do;
      Tensor tdKrdK = partition_fragment_C(typename Traits::TiledMmadK{},
                                           select<0, 1>(typename Traits::TileShapedK{}));
      Tensor tdVrdV = partition_fragment_C(typename Traits::TiledMmadV{},
                                           select<0, 1>(typename Traits::TileShapedV{}));
      Mainloop::mma(params.mainloop, storage.mainloop, pipeline_q, pipeline_do,
                    read_q, read_do, tdKrdK, tdVrdV, thread_idx, n_block, head, seqs.at(tile.batch));
      Seq const seq = seqs.at(tile.batch);
      Epilogue::store(params.epilogue, tdKrdK, tdVrdV, storage.mainloop.smem_k.data(), storage.mainloop.smem_v.data(),
                      storage.mainloop.smem_q.data(), thread_idx, n_block, head, seq);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    flash_bwd_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) char smem[];
  Kernel{}(params, smem);
#endif
}

}  // namespace flash3
