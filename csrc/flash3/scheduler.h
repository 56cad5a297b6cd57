// Tile scheduler: which (query tile, head, batch) each CTA works on.
#pragma once

#include <cutlass/cutlass.h>

namespace flash3 {

// A tile's place in the sectioned order: its (batch, head) pair and its rank within the
// head (0: the first, longest, tile). Tiles [s * section * per_head, (s + 1) * section *
// per_head) form section s, rank-major; the last section may hold fewer pairs.
struct SectionedTile {
  int bh;
  int rank;
};

CUTLASS_HOST_DEVICE SectionedTile sectioned_tile(int tile, int per_head, int section, int num_bh) {
  int const per_section = section * per_head;
  int const s = tile / per_section;
  int const first_bh = s * section;
  int const pairs = num_bh - first_bh < section ? num_bh - first_bh : section;
  int const r = tile - s * per_section;
  int const rank = r / pairs;
  return {first_bh + (r - rank * pairs), rank};
}

// How many (batch, head) pairs a section holds: the largest power of two whose heads'
// tiles fit on the SMs at one tile each, so that every head of a section starts its
// longest tile in the first round; 1 where one head has more tiles than half the SMs
// (then head by head already fills the GPU with one head's tiles).
// Measured on the H200 (causal, bf16, one process; docs/performance.md): forward +2..+9%
// at 2k-8k tokens, backward +2..+4% at 2k-4k; at 16k tokens, where this gives 1, no size
// gained (and 16 lost 10% in the backward); sizes that are not powers of two gained less
// or lost.
CUTLASS_HOST_DEVICE int section_size(int tiles_per_head, int num_sms, int num_bh) {
  int n = 1;
  while (2 * n * tiles_per_head <= num_sms) { n *= 2; }
  return n < num_bh ? n : (num_bh > 0 ? num_bh : 1);
}

// Tile order: the query tiles of one (batch, head) are consecutive, so CTAs running at
// the same time read the same K and V through L2 (at 16k tokens a head's K and V are
// 8 MB; without that reuse a causal forward at hdim 128 would move more bytes than its
// math takes time).
//
// kPersistent: a grid of min(tiles, SMs) CTAs walks the tile list with a static stride.
// Staying resident lets the producer load the next tile's K, V and Q while the consumers
// finish the current one, which matters most for short sequences, where a tile is a few
// microseconds of math (+8% at 512 tokens, hdim 128, measured on the H200).
//
// Otherwise one CTA per tile, handed out by the hardware in tile order as SMs free up:
// dynamic load balancing, which tiles of unequal length need. Under a causal mask the
// last query tiles see the most keys; within a head they come first (longest first), so
// the long tiles start early and the short ones fill the tail. (A static stride over
// unequal tiles was measured 37% slower at 16k tokens: 132 CTAs over 128-tile heads give
// each CTA a biased mix. A dynamic persistent grid, with an atomic tile counter and the
// tile index handed to the consumers through shared memory, was 16% faster at 512 tokens
// causal but 3-10% slower everywhere else in an A/B run on one H200, so it is not used.)
//
// Without kPersistent, with kLongestFirst (the causal kernels with one CTA per tile):
// the tiles of a section of `section` (batch, head) pairs are interleaved, longest first:
// the longest tile of each of the section's heads, then the second longest of each, and
// so on (section_size() picks how many). Where a head has few tiles, head by head puts
// the long and the short tiles of a couple of heads in one round; a section starts the
// longest tiles of all its heads in the first round and fills in with the short ones.
//
// kPersistent with kLongestFirst (the persistent causal and local kernels, traits.h): a static
// order that balances tiles of unequal length, with no tile index through shared memory
// (each warp computes its own sequence), one of two chosen per problem shape on the host
// (scheduler_tail.h):
// - the snake: the grid walks the tile list (each head's tiles longest first) in rounds
//   of gridDim.x tiles, forwards in even rounds and backwards in odd ones, so a CTA that
//   drew a long tile in one round draws a short one in the next. With M query tiles per
//   head this balances each pair of rounds where M divides 2 * gridDim.x, and nearly
//   where a round spans many heads; at 16k tokens, hdim 128 (M = 128, 132 SMs) it leaves
//   the kernel 1.33x its balanced time (host model), measured 0.80x of one CTA per tile.
// - pairs: each head's tiles listed in pairs of equal work, its longest with its
//   shortest, its second longest with its second shortest, ... (ranks r and M - 1 - r walk
//   M + 1 key tiles between them), and a pair per CTA and round (pair p to CTA
//   p % gridDim.x): balanced whatever M. But every CTA then runs its long tile and its
//   short one at the same time as the others, and short tiles are mostly loads and
//   stores: where the snake balances, pairs measured 1-5% slower (H100, hdim 128 causal
//   512-1k tokens, hdim 256 2k-4k), so the snake is the default.

// The snake: a persistent grid's next tile after `tile`, walking the list in rounds of
// gridDim.x tiles, forwards in even rounds and backwards in odd ones.
// (cta of ctas: blockIdx.x of gridDim.x; explicit so that the host can walk it too.)
CUTLASS_HOST_DEVICE int snake_next_tile(int tile, int ctas, int cta) {
  int const round = tile / ctas + 1;
  return round * ctas + (round % 2 == 0 ? cta : ctas - 1 - cta);
}

// Pairs: position `pos` of a head's list -> the rank of its tile (0: the longest): ranks
// 0, M - 1, 1, M - 2, ...
CUTLASS_HOST_DEVICE int paired_rank(int pos, int per_head) {
  return pos % 2 == 0 ? pos / 2 : per_head - 1 - pos / 2;
}

template <bool kPersistent, bool kLongestFirst>
struct TileScheduler {
  struct Params {
    int num_m_blocks;
    int nheads;
    int num_tiles;
    int section;  // (batch, head) pairs per section; 1: head by head
    int per_round;  // kBalanced: tiles per CTA and round: 1, the snake; 2, pairs
  };

  struct Coord {
    int m_block;
    int head;
    int batch;
  };

  static constexpr bool kSectioned = !kPersistent && kLongestFirst;
  static constexpr bool kBalanced = kPersistent && kLongestFirst;  // the snake or pairs

  // per_round (kBalanced): 1, the snake; 2, pairs (scheduler_tail.h picks it, 2 only where
  // the tiles outnumber the SMs).
  static Params to_params(int num_m_blocks, int nheads, int batch, int num_sms = 0, int per_round = 1) {
    int const section = kSectioned ? section_size(num_m_blocks, num_sms, nheads * batch) : 1;
    return {num_m_blocks, nheads, num_m_blocks * nheads * batch, section, kBalanced ? per_round : 1};
  }

  static dim3 grid(Params const& params, int num_sms) {
    int const units = (params.num_tiles + params.per_round - 1) / params.per_round;
    return dim3(kPersistent && num_sms < units ? num_sms : units);
  }

  // The tiles CTA `cta` of `ctas` walks (the device passes blockIdx.x and gridDim.x).
  CUTLASS_HOST_DEVICE static int first_tile(Params const& params, int cta) { return cta * params.per_round; }
  CUTLASS_HOST_DEVICE static int next_tile(Params const& params, int tile, int ctas, int cta) {
    if constexpr (!kPersistent) {
      return params.num_tiles;
    } else if constexpr (kBalanced) {
      if (params.per_round == 1) { return snake_next_tile(tile, ctas, cta); }
      // The pair's second tile, else the first of the CTA's next pair.
      return tile % 2 == 0 ? tile + 1 : tile + 2 * ctas - 1;
    } else {
      return tile + ctas;
    }
  }
  CUTLASS_DEVICE static int first_tile(Params const& params) { return first_tile(params, int(blockIdx.x)); }
  CUTLASS_DEVICE static int next_tile(Params const& params, int tile) {
    return next_tile(params, tile, int(gridDim.x), int(blockIdx.x));
  }

  CUTLASS_HOST_DEVICE static Coord coord(Params const& params, int tile) {
    int bh, m;
    if constexpr (kSectioned) {
      SectionedTile const st = sectioned_tile(tile, params.num_m_blocks, params.section,
                                              params.num_tiles / params.num_m_blocks);
      bh = st.bh;
      m = st.rank;
    } else {
      bh = tile / params.num_m_blocks;
      m = tile - bh * params.num_m_blocks;
      if constexpr (kBalanced) {
        if (params.per_round == 2) { m = paired_rank(m, params.num_m_blocks); }
      }
    }
    return {kLongestFirst ? params.num_m_blocks - 1 - m : m, bh % params.nheads, bh / params.nheads};
  }
};

}  // namespace flash3
