// The tile schedule of packed (variable-length) batches: a list of the batch's real tiles,
// written on the device by a small kernel before each packed-batch kernel runs.
//
// A grid over the longest sequence's tiles for every sequence and head (the dense
// scheduler's) launches mostly empty CTAs on a long-tailed mix: 65536 tokens in 20
// sequences of 153-14716 tokens have 522 query tiles of 128 rows but 20 x 115 grid rows.
// The host knows only the total and the longest length (no synchronisation), which bounds
// the tiles by total / block_m + batch per head; the device knows each sequence's length.
// So a table kernel (csrc/packed_tiles.cu) lists each real tile once, as (sequence, head,
// query tile) with the sequence's lengths and offsets, and the grid covers the host's
// bound; entries past the real tiles say so.
//
// Order: sequences by decreasing key count (they have the longest tiles), where the batch
// holds at most kPackedSortedMax sequences (else in batch order); within a sequence head by
// head, so that CTAs running at the same time share a head's K and V in L2; within a
// head, causal and local tiles longest first, and where the kernel is not persistent the
// heads of a sequence in the sections of the dense causal kernels (scheduler.h).
//
// One CTA per tile where the kernel is not persistent (the hardware hands tiles out in
// list order as SMs free up). A persistent grid does the same by itself: each CTA starts
// on the entry of its index and then claims the next unclaimed entry from a counter in
// global memory (zeroed by the table kernel) whenever its producer moves on, so the list
// is dealt greedily, longest first, to whichever CTA frees up first. (A static snake over
// the list balanced it poorly: the list is sorted by sequence, then head, then tile, so
// its rounds repeat each sequence's long-to-short run: on 8 sequences of 7-2000 tokens, 16
// heads, causal, its busiest CTA got 42 key tiles of work against the greedy deal's 30 and
// an average of 29, and that call ran 1.30x faster with the claims; docs/performance.md.)
#pragma once

#include <cuda_runtime.h>

#include <cutlass/cutlass.h>

#include "params.h"
#include "scheduler.h"

namespace flash3 {

// Sequences sorted by key count up to this many per batch (one CTA ranks them in shared memory).
constexpr int kPackedSortedMax = 1024;

// What the table kernel needs: the batch layout (seqlen.h SeqLayout's pointers) and the
// query tiling. The keys' lengths order the sequences (a tile's work grows with them).
struct PackedTileArgs {
  int const* cu_seqlens_q;
  int const* cu_seqlens_k;
  int const* seqused_q;  // or null
  int const* seqused_k;  // or null
  bool split_keys;  // split-KV parts (seqlen.h)
  int batch;
  int nheads;
  int block_rows;  // query rows per tile
  bool last_first;  // each head's tiles from the last one
  // Multiprocessors: a sequence's heads in sections whose first tiles start together
  // (scheduler.h section_size, the dense causal kernels' order); 0: head by head.
  int section_sms;
  struct PackedTileEntry* tiles;
  int num_entries;
  int* claimed;  // the persistent kernels' claim counter (zeroed here), or null
};

// Launches the table kernel (csrc/packed_tiles.cu) on the stream.
cudaError_t launch_packed_tile_table(PackedTileArgs const& args, cudaStream_t stream);

// One entry of the table: the tile and its sequence, so that the table is the only read a
// CTA waits for before it loads its tile (entries without the sequence, then a read of
// cu_seqlens, were 3% and 6% slower on a long-tailed mix at causal hdim 128 and 256).
struct alignas(16) PackedTileEntry {
  int batch;  // -1: past the batch's tiles
  int block_head;  // block * nheads + head
  int seqlen_q;
  int seqlen_k;
  int offset_q;
  int offset_k;
  int keys_after;  // seqlen.h Seq::keys_after
  int unused;
};
static_assert(sizeof(PackedTileEntry) == 8 * sizeof(int), "params.h counts the table in 8-int entries");

// The host's count of table entries for query tiles of block_rows rows (at most the
// table's capacity).
inline int packed_tile_entries(FwdParams const& p, int block_rows) {
  int64_t const bound = packed_tile_bound(p.total_q, p.batch, p.nheads, block_rows);
  return int(bound < p.packed_tiles_capacity ? bound : p.packed_tiles_capacity);
}

// Whether a persistent kernel's grid over the longest sequence (block_rows-row tiles) holds
// more tiles than the host's bound: then it walks the table, else the dense order (below).
// The persistent kernels' claim counter: one int past the table's capacity (api.cpp
// allocates one entry more).
inline int* packed_tile_counter(FwdParams const& p) {
  return p.packed_tiles + int64_t(p.packed_tiles_capacity) * (sizeof(PackedTileEntry) / sizeof(int));
}

inline bool packed_grid_exceeds_bound(FwdParams const& p, int block_rows) {
  int64_t const longest = (p.seqlen_q + block_rows - 1) / block_rows;
  return longest * p.batch * p.nheads > packed_tile_bound(p.total_q, p.batch, p.nheads, block_rows);
}

// Block of an entry past the real tiles: past every sequence's rows (times any block of
// at most 512 rows, still an int).
constexpr int kPackedPastRows = 1 << 21;

struct PackedTile {
  int block;
  int head;
  int batch;
};

CUTLASS_DEVICE PackedTile packed_tile_at(PackedTileEntry const* tiles, int entry, int nheads) {
  int const batch = tiles[entry].batch, block_head = tiles[entry].block_head;
  if (batch < 0) { return {kPackedPastRows, 0, 0}; }
  int const block = block_head / nheads;
  return {block, block_head - block * nheads, batch};
}

// Brings an entry into L1 ahead of its first read (a CTA's first tile, while it sets up).
CUTLASS_DEVICE void packed_tile_prefetch(PackedTileEntry const* tiles, int entry) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(tiles + entry));
}

// The entry's sequence (no rows and no keys past the batch's tiles).
CUTLASS_DEVICE Seq packed_seq_at(PackedTileEntry const* tiles, int entry) {
  PackedTileEntry const& e = tiles[entry];
  int const batch = e.batch < 0 ? 0 : e.batch;
  return {e.seqlen_q, e.seqlen_k, e.offset_q, e.offset_k, 0, varlen_padded_offset(e.offset_q, batch), e.keys_after};
}

// Without the table: persistent kernels keep the dense batches' scheduler `Dense` and its
// order (the snake or pairs, with its dealt tail) where their grid over the longest sequence holds
// no more tiles than the host's bound (equal or near-equal lengths, decoding); the other
// kernels run one CTA per sequence and head where every sequence fits one tile
// (decoding: no table kernel before a call of a few microseconds). (The dense scheduler
// beside the table in the one-CTA-per-tile kernels made ptxas spill 100-200 B at hdim
// 256; they have the dense order within each sequence from the table anyway.)
// With the table: one CTA per entry where the kernel is not persistent; where it is, the
// grid's first entries and then entries claimed one by one (above).
template <class Dense, bool kPersistent>
struct PackedTileScheduler {
  struct Params {
    typename Dense::Params dense;  // used by persistent kernels only
    PackedTileEntry const* tiles;  // or null
    int num_tiles;  // the table's entries (the host's bound), or the tiles without it
    int nheads;
    int* claimed;  // persistent kernels with the table: entries claimed past the grid's first
  };
  // Persistent kernels learn their tiles as they go (with the table): only the producer
  // walks first_tile / next_tile, and hands each tile to the consumers (kernel_fwd.h,
  // tile_handoff.h).
  using Coord = typename Dense::Coord;

  static bool uses_table(FwdParams const& p, int block_rows) {
    if (p.packed_tiles == nullptr) { return false; }
    if constexpr (kPersistent) {
      return packed_grid_exceeds_bound(p, block_rows);
    } else {
      return p.seqlen_q > block_rows;  // more than one tile in the longest sequence
    }
  }

  static Params to_params(FwdParams const& p, int block_rows, typename Dense::Params const& dense) {
    if (uses_table(p, block_rows)) {
      return {dense, reinterpret_cast<PackedTileEntry const*>(p.packed_tiles), packed_tile_entries(p, block_rows),
              p.nheads, kPersistent ? packed_tile_counter(p) : nullptr};
    }
    return {dense, nullptr, kPersistent ? dense.num_tiles : p.batch * p.nheads, p.nheads, nullptr};
  }

  static dim3 grid(Params const& params, int num_sms) {
    if constexpr (kPersistent) {
      if (params.tiles == nullptr) { return Dense::grid(params.dense, num_sms); }
      return dim3(num_sms < params.num_tiles ? num_sms : params.num_tiles);
    } else {
      return dim3(params.num_tiles);
    }
  }

  CUTLASS_DEVICE static int first_tile(Params const& params) {
    if constexpr (kPersistent) {
      if (params.tiles == nullptr) { return Dense::first_tile(params.dense); }
      return real_or_end(params, int(blockIdx.x));
    }
    return int(blockIdx.x);
  }
  // With the table, a persistent kernel's producer thread alone calls it: it claims an entry.
  CUTLASS_DEVICE static int next_tile(Params const& params, int tile) {
    if constexpr (kPersistent) {
      if (params.tiles == nullptr) { return Dense::next_tile(params.dense, tile); }
      return real_or_end(params, int(gridDim.x) + atomicAdd(params.claimed, 1));
    } else {
      return params.num_tiles;
    }
  }
  // The entries are the real tiles first, so the first entry past them ends the walk.
  CUTLASS_DEVICE static int real_or_end(Params const& params, int tile) {
    return tile < params.num_tiles && params.tiles[tile].batch >= 0 ? tile : params.num_tiles;
  }

  CUTLASS_DEVICE static Coord coord(Params const& params, int tile) {
    if (params.tiles == nullptr) {
      if constexpr (kPersistent) {
        return Dense::coord(params.dense, tile);
      } else {
        int const batch = tile / params.nheads;
        return {0, tile - batch * params.nheads, batch};
      }
    }
    PackedTile const t = packed_tile_at(params.tiles, tile, params.nheads);
    return {t.block, t.head, t.batch};
  }

  // Tile t's sequence: from its table entry, or from the batch layout.
  CUTLASS_DEVICE static Seq seq(Params const& params, SeqLayout const& seqs, int tile, int batch) {
    return params.tiles != nullptr ? packed_seq_at(params.tiles, tile) : seqs.at_packed(batch);
  }
};

}  // namespace flash3
