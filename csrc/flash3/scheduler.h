// Tile scheduler: which (query tile, head, batch) each CTA works on.
#pragma once

#include <cutlass/cutlass.h>

namespace flash3 {

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
// kPersistent with kLongestFirst (the causal short-sequence tiles, traits.h): the grid
// walks the tile list in rounds of gridDim.x tiles, forwards in even rounds and
// backwards in odd ones (a snake). Within a head the tiles run longest first, so a CTA
// that drew a long tile in one round draws a short one in the next: with M query tiles
// per head and M dividing 2 * gridDim.x, every pair of rounds gives each CTA the same
// work. No tile index crosses shared memory; each warp computes its own sequence.
template <bool kPersistent, bool kLongestFirst>
struct TileScheduler {
  struct Params {
    int num_m_blocks;
    int nheads;
    int num_tiles;
  };

  struct Coord {
    int m_block;
    int head;
    int batch;
  };

  static Params to_params(int num_m_blocks, int nheads, int batch) {
    return {num_m_blocks, nheads, num_m_blocks * nheads * batch};
  }

  static dim3 grid(Params const& params, int num_sms) {
    return dim3(kPersistent && num_sms < params.num_tiles ? num_sms : params.num_tiles);
  }

  static constexpr bool kSnake = kPersistent && kLongestFirst;

  CUTLASS_DEVICE static int first_tile() { return int(blockIdx.x); }
  CUTLASS_DEVICE static int next_tile(Params const& params, int tile) {
    if constexpr (!kPersistent) {
      return params.num_tiles;
    } else if constexpr (kSnake) {
      int const ctas = int(gridDim.x);
      int const round = tile / ctas + 1;
      return round * ctas + (round % 2 == 0 ? int(blockIdx.x) : ctas - 1 - int(blockIdx.x));
    } else {
      return tile + int(gridDim.x);
    }
  }

  CUTLASS_DEVICE static Coord coord(Params const& params, int tile) {
    int const bh = tile / params.num_m_blocks;
    int const m = tile - bh * params.num_m_blocks;
    return {kLongestFirst ? params.num_m_blocks - 1 - m : m, bh % params.nheads, bh / params.nheads};
  }
};

}  // namespace flash3
