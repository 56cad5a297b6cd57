// The forward kernel's K and V pipelines between the producer warpgroup and the consumer
// warpgroups, and the producer's position in them. Two forms, by Traits::kTransposeV:
// - 16-bit inputs: K and V each go from TMA straight to the consumers' GEMMs;
// - e4m3 inputs: K as above; V from TMA to the producer warpgroup's transposer (every
//   producer thread releases a stage), and V^T from the transposer (every producer
//   thread arrives) to the consumers.
// The consumers' PV GEMM reads the pipeline pv(): V, or V^T.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

namespace flash3 {

// A TMA pipeline's parameters: the producer warp's elected thread (leader) arrives with
// the transaction bytes; each of `consumers` threads releases a stage, and (CUTLASS 4,
// one-CTA cluster) the pipeline counts every one's arrival.
template <class Pipeline>
CUTLASS_DEVICE typename Pipeline::Params tma_pipeline_params(typename Pipeline::ThreadCategory role, bool leader,
                                                             uint32_t transaction_bytes, int consumers) {
  typename Pipeline::Params p;
  p.transaction_bytes = transaction_bytes;
  p.num_consumers = consumers;
  p.role = role;
  p.is_leader = leader;
  return p;
}

template <class Traits, bool kTransposeV = Traits::kTransposeV>
struct FwdPipelines;

// K and V each from TMA to the consumers.
template <class Traits>
struct FwdPipelines<Traits, false> {
  using PipelineK = cutlass::PipelineTmaAsync<Traits::kStages>;
  using PipelineV = cutlass::PipelineTmaAsync<Traits::kStages>;
  using PipelinePV = PipelineV;
  using PipelineState = cutlass::PipelineState<Traits::kStages>;
  struct SharedStorage {
    alignas(16) typename PipelineK::SharedStorage k;
    alignas(16) typename PipelineV::SharedStorage v;
  };
  // Where the producer writes the next K and the next V.
  struct ProducerState {
    PipelineState k = cutlass::make_producer_start_state<PipelineK>();
    PipelineState v = cutlass::make_producer_start_state<PipelineV>();
  };

  PipelineK k;
  PipelineV v;

  CUTLASS_DEVICE static typename PipelineK::Params params_of(bool producer, bool leader, uint32_t bytes) {
    return tma_pipeline_params<PipelineK>(
        producer ? PipelineK::ThreadCategory::Producer : PipelineK::ThreadCategory::Consumer, producer && leader,
        bytes, Traits::kConsumerThreads);
  }
  CUTLASS_DEVICE FwdPipelines(SharedStorage& storage, bool producer, bool leader)
      : k(storage.k, params_of(producer, leader, Traits::kBytesK), cute::Shape<cute::_1, cute::_1, cute::_1>{}),
        v(storage.v, params_of(producer, leader, Traits::kBytesV), cute::Shape<cute::_1, cute::_1, cute::_1>{}) {}
  CUTLASS_DEVICE PipelinePV& pv() { return v; }
};

// K: TMA -> consumers. V: TMA -> the producer warpgroup's transposer. V^T: transposer ->
// consumers.
template <class Traits>
struct FwdPipelines<Traits, true> {
  using PipelineK = cutlass::PipelineTmaAsync<Traits::kStages>;
  using PipelineV = cutlass::PipelineTmaAsync<Traits::kStages>;
  using PipelineVt = cutlass::PipelineAsync<Traits::kStages>;
  using PipelinePV = PipelineVt;
  using PipelineState = cutlass::PipelineState<Traits::kStages>;
  struct SharedStorage {
    alignas(16) typename PipelineK::SharedStorage k;
    alignas(16) typename PipelineV::SharedStorage v;
    alignas(16) typename PipelineVt::SharedStorage vt;
  };
  // The V stage the transposer reads next and the V^T stage it writes: they advance
  // together, and K and V stages are written one key tile ahead of it, so one state
  // serves all three (mainloop_fwd.h; registers: the producer runs on 24 at hdim 256).
  struct ProducerState {
    PipelineState transpose = cutlass::make_producer_start_state<PipelineVt>();
  };

  PipelineK k;
  PipelineV v;
  PipelineVt vt;

  CUTLASS_DEVICE static typename PipelineK::Params params_k(bool producer, bool leader) {
    return tma_pipeline_params<PipelineK>(
        producer ? PipelineK::ThreadCategory::Producer : PipelineK::ThreadCategory::Consumer, leader,
        Traits::kBytesK, Traits::kConsumerThreads);
  }
  // Every producer thread reads (transposes) a V stage and releases it.
  CUTLASS_DEVICE static typename PipelineV::Params params_v(bool producer, bool leader) {
    return tma_pipeline_params<PipelineV>(
        producer ? PipelineV::ThreadCategory::ProducerConsumer : PipelineV::ThreadCategory::NonParticipant, leader,
        Traits::kBytesV, cutlass::NumThreadsPerWarpGroup);
  }
  CUTLASS_DEVICE static typename PipelineVt::Params params_vt(bool producer) {
    typename PipelineVt::Params p;
    p.producer_arv_count = cutlass::NumThreadsPerWarpGroup;
    p.consumer_arv_count = Traits::kConsumerThreads;
    p.role = producer ? PipelineVt::ThreadCategory::Producer : PipelineVt::ThreadCategory::Consumer;
    return p;
  }
  CUTLASS_DEVICE FwdPipelines(SharedStorage& storage, bool producer, bool leader)
      : k(storage.k, params_k(producer, leader), cute::Shape<cute::_1, cute::_1, cute::_1>{}),
        v(storage.v, params_v(producer, leader), cute::Shape<cute::_1, cute::_1, cute::_1>{}),
        vt(storage.vt, params_vt(producer)) {}
  CUTLASS_DEVICE PipelinePV& pv() { return vt; }
};

}  // namespace flash3
