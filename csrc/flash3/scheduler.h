// Tile schedulers: which (query tile, head, batch) a CTA works on.
#pragma once

#include <cutlass/cutlass.h>

namespace flash3 {

// One CTA per query tile, grid (m_blocks, heads, batch). Under a causal mask the last
// query tiles see the most keys; they are handed out first (blockIdx.x = 0 takes the
// last tile) so the long CTAs start in the first wave and the short ones fill the tail.
template <bool kLongestFirst>
struct SingleTileScheduler {
  struct Coord {
    int m_block;
    int head;
    int batch;
  };

  static dim3 grid(int num_m_blocks, int nheads, int batch) { return dim3(num_m_blocks, nheads, batch); }

  CUTLASS_DEVICE static Coord tile() {
    int const m_block = kLongestFirst ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
    return {m_block, int(blockIdx.y), int(blockIdx.z)};
  }
};

}  // namespace flash3
