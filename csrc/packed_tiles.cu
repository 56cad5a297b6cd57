// The tile table of a packed batch (flash3/scheduler_packed.h): which (sequence, head,
// tile) each entry of a packed-batch kernel's grid works on; tiles of queries in the
// forward, of keys in the backward.
//
// Each CTA fills its own slice of the table. It reads every sequence's lengths (the batch
// in chunks of kChunk sequences), ranks them by the other side's length when the batch is
// small enough to sort (kPackedSortedMax), sums their tiles in rank order and, for each
// entry of its slice, finds the sequence whose tiles hold it by a binary search over those
// sums. The work per CTA is a few microseconds at batch 1024 and far less at the usual
// sizes; the table is (total / block_rows + batch) * nheads entries of 8 bytes.
#include <cub/block/block_scan.cuh>

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
  __shared__ int other_rows[kChunk];     // per sequence of the chunk, in batch order: the other side's rows
  __shared__ int blocks_raw[kChunk];     // ... and its tiles
  __shared__ int seq_of_rank[kChunk];    // the chunk's sequences in schedule order
  __shared__ int blocks[kChunk];         // their tiles
  __shared__ int first_entry[kChunk + 1];  // their first entry, from the chunk's first
  __shared__ int chunk_entries;

  int const slice_begin = int(blockIdx.x) * kThreads * kEntriesPerThread;
  int const slice_end = min(slice_begin + kThreads * kEntriesPerThread, args.num_entries);
  bool const sorted = args.batch <= kPackedSortedMax;
  int chunk_begin_entry = 0;  // entries of the chunks before this one
  for (int chunk = 0; chunk < args.batch && chunk_begin_entry < slice_end; chunk += kChunk) {
    int const n = min(kChunk, args.batch - chunk);
    for (int i = threadIdx.x; i < n; i += kThreads) {
      int const b = chunk + i;
      int const rows = used_rows(args.cu_seqlens_tiled, args.seqused_tiled, b);
      blocks_raw[i] = (rows + args.block_rows - 1) / args.block_rows;
      other_rows[i] = used_rows(args.cu_seqlens_other, args.seqused_other, b);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += kThreads) {
      int rank = i;
      if (sorted) {  // longer first; equal ones in batch order
        int const key = other_rows[i];
        rank = 0;
        for (int j = 0; j < n; ++j) { rank += other_rows[j] > key || (other_rows[j] == key && j < i); }
      }
      seq_of_rank[rank] = i;
      blocks[rank] = blocks_raw[i];
    }
    __syncthreads();
    // Entries per rank (query tiles times heads), summed: thread t holds ranks
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
    if (threadIdx.x == 0) {
      first_entry[kChunk] = total;
      chunk_entries = total;
    }
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
      args.tiles[e] = make_int2(chunk + seq_of_rank[lo], block * args.nheads + head);
    }
    chunk_begin_entry += chunk_entries;
    __syncthreads();  // the shared arrays are the next chunk's
  }
  // Past the batch's tiles (there are such entries only when every chunk was walked).
  for (int e = slice_begin + int(threadIdx.x); e < slice_end; e += kThreads) {
    if (e >= chunk_begin_entry) { args.tiles[e] = make_int2(-1, 0); }
  }
}

}  // namespace

cudaError_t launch_packed_tile_table(PackedTileArgs const& args, cudaStream_t stream) {
  if (args.num_entries <= 0) { return cudaSuccess; }
  int const per_cta = kThreads * kEntriesPerThread;
  packed_tile_table_kernel<<<(args.num_entries + per_cta - 1) / per_cta, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace flash3
