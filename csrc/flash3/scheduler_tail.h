// The tile schedule of the persistent causal and local-mask forward kernels: one of scheduler.h's two
// balancing orders (the snake or pairs) for all but the last rounds, and the tiles of
// those last rounds dealt out on the host, longest first, each to the CTA with the least
// work so far (a greedy longest-processing-time schedule), passed to the kernel as a
// small table. The host models both orders' makespans and picks the snake unless pairs
// are shorter by more than kPairsMargin.
//
// Why the deal: the orders give every CTA the same work over each round (pairs) or pair
// of rounds (the snake), but a grid of G CTAs over N tiles leaves a last, partial round:
// at the paper grid's 4096 query tiles (hdim 64, 16k tokens) and 132 SMs, 4 CTAs run a
// 32nd tile while 128 idle, 3% of the kernel, whatever the tiles' lengths. Dealt out
// longest first to the least loaded CTAs, the last rounds' tiles even that out to within
// the shortest tiles (host model: +2..+3% at 512-2k tokens, docs/performance.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

#include <cutlass/cutlass.h>

#include "scheduler.h"

namespace flash3 {

struct TailBalancedScheduler {
  using Order = TileScheduler</*kPersistent=*/true, /*kLongestFirst=*/true>;
  using Coord = Order::Coord;
  static constexpr int kMaxCtas = 144;  // table rows; a larger grid keeps the plain order
  static constexpr int kMaxTailTiles = 6;  // per CTA
  // Pairs where their modelled makespan is this much shorter than the snake's (with each
  // one's dealt tail): where the model has them level, the snake measured 1-5% faster.
  static constexpr double kPairsMargin = 0.02;

  struct Params : Order::Params {
    int tail_begin;  // tiles [0, tail_begin) follow the order, the rest the table
    // Per CTA, its tail tiles in order, as offsets from tail_begin; -1 after the last.
    int16_t tail[kMaxCtas][kMaxTailTiles];
  };

  // The key tiles query tile m_block walks under a window of `left` keys before each row's
  // diagonal and `right` after it (mask.h MaskPolicy's local ranges, on the host; causal
  // is (seqlen_k, 0), which gives its n_block_end), plus a share for the tile's fixed
  // costs (its first S, last O += P V and epilogue run with nothing to overlap): the
  // host's model of a tile's time.
  static double tile_cost(int m_block, int seqlen_q, int seqlen_k, int block_m, int block_n, int left, int right) {
    int const n_blocks = (seqlen_k + block_n - 1) / block_n;
    int const offset = seqlen_k - seqlen_q;
    int const last_key = std::min((m_block + 1) * block_m, seqlen_q) - 1 + offset + right;
    int const n_end = last_key < 0 ? 0 : std::min(n_blocks, last_key / block_n + 1);
    int const first_key = m_block * block_m + offset - left;
    int const n_begin = first_key >= seqlen_k ? n_blocks : std::max(first_key, 0) / block_n;
    return n_end > n_begin ? n_end - n_begin + 0.5 : 0.1;
  }

  // Tile t's query tile (Order::coord, on the host): each head's tiles longest first
  // (the snake) or in pairs (scheduler.h paired_rank).
  static int m_block_of(Order::Params const& p, int t) {
    int const pos = t % p.num_m_blocks;
    return p.num_m_blocks - 1 - (p.per_round == 2 ? paired_rank(pos, p.num_m_blocks) : pos);
  }

  // The table for one problem shape and window (left, right: tile_cost; causal by
  // default); the last one's is kept, since a model runs the same shape over and over.
  static Params to_params(int num_m_blocks, int nheads, int batch, int num_sms, int seqlen_q, int seqlen_k,
                          int block_m, int block_n, int left = -1, int right = 0) {
    if (left < 0) { left = seqlen_k; }
    static thread_local std::vector<int> cached_key;
    static thread_local Params cached;
    std::vector<int> const key{num_m_blocks, nheads, batch, num_sms, seqlen_q, seqlen_k, block_m, block_n, left, right};
    if (key != cached_key) {
      cached = schedule(num_m_blocks, nheads, batch, num_sms, seqlen_q, seqlen_k, block_m, block_n, left, right);
      cached_key = key;
    }
    return cached;
  }

  // The snake, or pairs where the tiles outnumber the SMs and their modelled makespan is
  // shorter by kPairsMargin.
  static Params schedule(int num_m_blocks, int nheads, int batch, int num_sms, int seqlen_q, int seqlen_k, int block_m,
                         int block_n, int left, int right) {
    double snake_makespan = 0.0;
    Params const snake = deal(num_m_blocks, nheads, batch, num_sms, seqlen_q, seqlen_k, block_m, block_n, left, right,
                              1, &snake_makespan);
    if (int64_t(num_m_blocks) * nheads * batch <= num_sms) { return snake; }
    double pairs_makespan = 0.0;
    Params const pairs = deal(num_m_blocks, nheads, batch, num_sms, seqlen_q, seqlen_k, block_m, block_n, left, right,
                              2, &pairs_makespan);
    return pairs_makespan < (1.0 - kPairsMargin) * snake_makespan ? pairs : snake;
  }

  // One order (per_round: 1, the snake; 2, pairs) with its last rounds dealt out, and its
  // modelled makespan.
  static Params deal(int num_m_blocks, int nheads, int batch, int num_sms, int seqlen_q, int seqlen_k, int block_m,
                     int block_n, int left, int right, int per_round, double* makespan) {
    Params p;
    static_cast<Order::Params&>(p) = Order::to_params(num_m_blocks, nheads, batch, num_sms, per_round);
    p.tail_begin = p.num_tiles;
    for (auto& row : p.tail) {
      for (auto& x : row) { x = -1; }
    }
    int const ctas = int(Order::grid(p, num_sms).x);
    std::vector<double> cost(p.num_tiles);
    for (int t = 0; t < p.num_tiles; ++t) {
      cost[t] = tile_cost(m_block_of(p, t), seqlen_q, seqlen_k, block_m, block_n, left, right);
    }
    // The CTA of tile t (scheduler.h TileScheduler::next_tile).
    auto cta_of = [&](int t) {
      if (per_round == 2) { return (t / 2) % ctas; }
      int const r = t / ctas, i = t % ctas;
      return r % 2 == 0 ? i : ctas - 1 - i;
    };
    std::vector<double> order_load(ctas, 0.0);
    for (int t = 0; t < p.num_tiles; ++t) { order_load[cta_of(t)] += cost[t]; }
    double best = ctas > 0 ? *std::max_element(order_load.begin(), order_load.end()) : 0.0;
    *makespan = best;
    int const round_tiles = ctas * per_round;
    int const rounds = ctas > 0 ? p.num_tiles / round_tiles : 0;
    if (ctas > kMaxCtas || rounds < 2) { return p; }
    // Leave the last k full rounds and the partial one to the greedy deal; keep the k
    // whose modelled makespan is the shortest, or the plain order if none beats it.
    for (int k = 1; k <= 3 && k < rounds; ++k) {
      int const begin = (rounds - k) * round_tiles;
      std::vector<double> load(ctas, 0.0);
      for (int t = 0; t < begin; ++t) { load[cta_of(t)] += cost[t]; }
      std::vector<int> order;
      for (int t = begin; t < p.num_tiles; ++t) { order.push_back(t); }
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cost[a] > cost[b]; });
      using Slot = std::pair<double, int>;  // (load, CTA): the least loaded, then the lowest index
      std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> free_ctas;
      for (int c = 0; c < ctas; ++c) { free_ctas.push({load[c], c}); }
      std::vector<std::vector<int>> lists(ctas);
      bool fits = true;
      for (int t : order) {
        auto [l, c] = free_ctas.top();
        free_ctas.pop();
        lists[c].push_back(t - begin);
        fits = fits && int(lists[c].size()) <= kMaxTailTiles;
        load[c] = l + cost[t];
        free_ctas.push({load[c], c});
      }
      double const dealt = *std::max_element(load.begin(), load.end());
      if (!fits || dealt >= best) { continue; }
      best = dealt;
      *makespan = best;
      p.tail_begin = begin;
      for (int c = 0; c < ctas; ++c) {
        // Longest first within a CTA too: the order the deal produced.
        for (int j = 0; j < kMaxTailTiles; ++j) {
          p.tail[c][j] = j < int(lists[c].size()) ? int16_t(lists[c][j]) : int16_t(-1);
        }
      }
    }
    return p;
  }

  static dim3 grid(Params const& params, int num_sms) { return Order::grid(params, num_sms); }

  // A CTA's first tile is the order's: the table starts after at least one full round.
  // (cta of ctas: blockIdx.x of gridDim.x, explicit so that the host can walk it too.)
  CUTLASS_HOST_DEVICE static int first_tile(Params const& params, int cta) { return Order::first_tile(params, cta); }

  CUTLASS_HOST_DEVICE static int tail_tile(Params const& params, int j, int cta) {
    int const offset = j < kMaxTailTiles ? params.tail[cta][j] : -1;
    return offset >= 0 ? params.tail_begin + offset : params.num_tiles;
  }

  CUTLASS_HOST_DEVICE static int next_tile(Params const& params, int tile, int ctas, int cta) {
    if (tile < params.tail_begin) {
      int const next = Order::next_tile(params, tile, ctas, cta);
      return next < params.tail_begin ? next : tail_tile(params, 0, cta);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kMaxTailTiles - 1; ++j) {
      if (tail_tile(params, j, cta) == tile) { return tail_tile(params, j + 1, cta); }
    }
    return params.num_tiles;
  }

  CUTLASS_DEVICE static int first_tile(Params const& params) { return first_tile(params, int(blockIdx.x)); }
  CUTLASS_DEVICE static int next_tile(Params const& params, int tile) {
    return next_tile(params, tile, int(gridDim.x), int(blockIdx.x));
  }

  CUTLASS_HOST_DEVICE static Coord coord(Params const& params, int tile) { return Order::coord(params, tile); }
};

}  // namespace flash3
