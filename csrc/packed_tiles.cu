// The tile table of a packed batch (flash3/scheduler_packed.h): which (sequence, head,
// query tile) each entry of a packed-batch forward kernel's grid works on.
//
// Each CTA fills its own slice of the table. It reads every sequence's lengths (the batch
// in chunks of kChunk sequences), ranks them by the other side's length when the batch is
// small enough to sort (kPackedSortedMax), sums their tiles in rank order and, for each
// entry of its slice, finds the sequence whose tiles hold it by a binary search over those
// sums. The work per CTA is a few microseconds at batch 1024 and far less at the usual
// sizes; the table is (total / block_rows + batch) * nheads entries of 32 bytes.
#include <cub/block/block_scan.cuh>

#include "flash3/grid_dependency.h"
#include "flash3/scheduler_packed.h"

namespace flash3 {
namespace {

constexpr int kThreads = 512;
constexpr int kChunk = kPackedSortedMax;  // sequences per pass
constexpr int kSeqsPerThread = kChunk / kThreads;
constexpr int kEntriesPerThread = 8;      // table entries per thread and CTA
static_assert(kChunk % kThreads == 0, "a chunk is whole sequences per thread");

__device__ int used_rows(int const* cu_seqlens, int const* seqused, int b) {
  int const n = seqused != nullptr ? seqused[b] : cu_seqlens[b + 1] - cu_seqlens[b];
  return n > 0 ? n : 0;
}

__global__ void __launch_bounds__(kThreads) packed_tile_table_kernel(PackedTileArgs const args) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  // Per sequence of the chunk, in batch order: rows used and first row, of q and k.
  __shared__ int seqlen_q[kChunk], seqlen_k[kChunk], offset_q[kChunk], offset_k[kChunk], keys_after[kChunk];
  __shared__ int seq_of_rank[kChunk];      // the chunk's sequences in schedule order
  __shared__ int blocks[kChunk];           // their tiles
  __shared__ int first_entry[kChunk];      // their first entry, from the chunk's first
  __shared__ int chunk_entries;
  wait_for_prior_grids();  // the lengths may come from the kernel before (grid_dependency.h)
  allow_dependent_grids();

  if (args.claimed != nullptr && blockIdx.x == 0 && threadIdx.x == 0) { *args.claimed = 0; }
  int const slice_begin = int(blockIdx.x) * kThreads * kEntriesPerThread;
  int const slice_end = min(slice_begin + kThreads * kEntriesPerThread, args.num_entries);
  bool const sorted = args.batch <= kPackedSortedMax;
  int chunk_begin_entry = 0;  // entries of the chunks before this one
  for (int chunk = 0; chunk < args.batch && chunk_begin_entry < slice_end; chunk += kChunk) {
    int const n = min(kChunk, args.batch - chunk);
    for (int i = threadIdx.x; i < n; i += kThreads) {
      int const b = chunk + i;
      offset_q[i] = args.cu_seqlens_q[b];
      offset_k[i] = args.cu_seqlens_k[b];
      seqlen_q[i] = used_rows(args.cu_seqlens_q, args.seqused_q, b);
      SeqKeys const keys = split_seq_keys(used_rows(args.cu_seqlens_k, args.seqused_k, b), offset_k[i],
                                          args.cu_seqlens_k[b + 1], args.split_keys);
      seqlen_k[i] = keys.read;
      keys_after[i] = keys.after;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += kThreads) {
      int rank = i;
      if (sorted) {  // more keys first; equal ones in batch order
        int const key = seqlen_k[i];
        rank = 0;
        for (int j = 0; j < n; ++j) { rank += seqlen_k[j] > key || (seqlen_k[j] == key && j < i); }
      }
      seq_of_rank[rank] = i;
      blocks[rank] = (seqlen_q[i] + args.block_rows - 1) / args.block_rows;
    }
    __syncthreads();
    // Entries per rank (tiles times heads), summed: thread t holds ranks
    // [t * kSeqsPerThread, (t + 1) * kSeqsPerThread).
    int counts[kSeqsPerThread];
    for (int j = 0; j < kSeqsPerThread; ++j) {
      int const r = threadIdx.x * kSeqsPerThread + j;
      counts[j] = r < n ? blocks[r] * args.nheads : 0;
    }
    int firsts[kSeqsPerThread];
    int total;
    Scan(scan_storage).ExclusiveSum(counts, firsts, total);
    for (int j = 0; j < kSeqsPerThread; ++j) { first_entry[threadIdx.x * kSeqsPerThread + j] = firsts[j]; }
    if (threadIdx.x == 0) { chunk_entries = total; }
    __syncthreads();
    for (int e = slice_begin + int(threadIdx.x); e < slice_end; e += kThreads) {
      int const local = e - chunk_begin_entry;
      if (local < 0 || local >= chunk_entries) { continue; }
      int lo = 0, hi = n - 1;  // the last rank whose first entry is <= local
      while (lo < hi) {
        int const mid = (lo + hi + 1) / 2;
        if (first_entry[mid] <= local) { lo = mid; } else { hi = mid - 1; }
      }
      int const within = local - first_entry[lo];
      int const tiles = blocks[lo];
      int head, block;
      if (args.section_sms > 0) {  // the sequence's heads in sections, as dense batches' (scheduler.h)
        SectionedTile const st =
            sectioned_tile(within, tiles, section_size(tiles, args.section_sms, args.nheads), args.nheads);
        head = st.bh;
        block = st.rank;
      } else {
        head = within / tiles;
        block = within - head * tiles;
      }
      if (args.last_first) { block = tiles - 1 - block; }
      int const i = seq_of_rank[lo];
      PackedTileEntry entry;
      entry.batch = chunk + i;
      entry.block_head = block * args.nheads + head;
      entry.seqlen_q = seqlen_q[i];
      entry.seqlen_k = seqlen_k[i];
      entry.offset_q = offset_q[i];
      entry.offset_k = offset_k[i];
      entry.keys_after = keys_after[i];
      entry.unused = 0;
      args.tiles[e] = entry;
    }
    chunk_begin_entry += chunk_entries;
    __syncthreads();  // the shared arrays are the next chunk's
  }
  // Past the batch's tiles (there are such entries only when every chunk was walked).
  for (int e = slice_begin + int(threadIdx.x); e < slice_end; e += kThreads) {
    if (e >= chunk_begin_entry) { args.tiles[e] = PackedTileEntry{-1, 0, 0, 0, 0, 0, 0, 0}; }
  }
}

}  // namespace

cudaError_t launch_packed_tile_table(PackedTileArgs const& args, cudaStream_t stream) {
  if (args.num_entries <= 0) { return cudaSuccess; }
  int const per_cta = kThreads * kEntriesPerThread;
  return launch_after_prior_grid(&packed_tile_table_kernel, dim3((args.num_entries + per_cta - 1) / per_cta),
                                 dim3(kThreads), 0, stream, args);
}

}  // namespace flash3
