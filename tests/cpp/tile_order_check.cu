// Host check of the persistent forward kernels' tile orders (csrc/flash3/scheduler.h,
// scheduler_tail.h): for random problem shapes and grid sizes, every CTA's walk (first
// tile, then next tile until past the last) visits every tile exactly once, and every
// (batch, head, query tile) once, in the snake, in pairs and with a dealt tail; and the
// host picks pairs where its model finds the snake unbalanced. Built and run by
// tests/test_tile_order.py; prints "ok" and the number of cases, or the first failure.
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>
#include <vector>

#include "flash3/scheduler_tail.h"

namespace {

using flash3::TailBalancedScheduler;
using Snake = flash3::TileScheduler</*kPersistent=*/true, /*kLongestFirst=*/true>;
using Strided = flash3::TileScheduler</*kPersistent=*/true, /*kLongestFirst=*/false>;

// Walks every CTA of the grid; false (with a message) unless each tile and each
// (batch, head, m_block) is visited once.
template <class Sched, class P>
bool covers_once(P const& p, int num_sms, char const* what) {
  int const ctas = int(Sched::grid(p, num_sms).x);
  std::vector<int> seen(p.num_tiles, 0), coord_seen(p.num_tiles, 0);
  for (int cta = 0; cta < ctas; ++cta) {
    int steps = 0;
    for (int t = Sched::first_tile(p, cta); t < p.num_tiles; t = Sched::next_tile(p, t, ctas, cta)) {
      if (t < 0 || ++steps > p.num_tiles) {
        std::printf("FAIL %s: CTA %d walks tile %d (step %d)\n", what, cta, t, steps);
        return false;
      }
      ++seen[t];
      auto const c = Sched::coord(p, t);
      int const bh = c.batch * p.nheads + c.head;
      if (c.m_block < 0 || c.m_block >= p.num_m_blocks || bh < 0 || bh * p.num_m_blocks >= p.num_tiles) {
        std::printf("FAIL %s: tile %d -> m_block %d, head %d, batch %d\n", what, t, c.m_block, c.head, c.batch);
        return false;
      }
      ++coord_seen[bh * p.num_m_blocks + c.m_block];
    }
  }
  for (int t = 0; t < p.num_tiles; ++t) {
    if (seen[t] != 1 || coord_seen[t] != 1) {
      std::printf("FAIL %s: tile %d visited %d times, coordinate %d visited %d times (tiles %d, grid %d, per round "
                  "%d)\n",
                  what, t, seen[t], t, coord_seen[t], p.num_tiles, ctas, p.per_round);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int const cases = argc > 1 ? std::atoi(argv[1]) : 300;
  std::mt19937 rng(20261205);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int const sms_choices[] = {132, 114, 78, 16, 1};
  int checked = 0, paired = 0;
  for (int i = 0; i < cases; ++i) {
    int const block_m = uniform(0, 1) ? 128 : 192;
    int const block_n = 64 * uniform(1, 3);
    int const seqlen_q = uniform(1, 40 * block_m);
    int const seqlen_k = uniform(0, 3) == 0 ? uniform(1, 3 * seqlen_q) : seqlen_q;
    int const nheads = uniform(1, 40), batch = uniform(1, 6);
    int const num_sms = sms_choices[uniform(0, 4)];
    int const m_blocks = (seqlen_q + block_m - 1) / block_m;
    auto const p = TailBalancedScheduler::to_params(m_blocks, nheads, batch, num_sms, seqlen_q, seqlen_k, block_m,
                                                    block_n);
    paired += p.per_round == 2;
    if (!covers_once<TailBalancedScheduler>(p, num_sms, "dealt order")) { return 1; }
    // The local mask's kernels deal their tails by the keys under their window.
    int const left = uniform(0, 1) ? seqlen_k : uniform(0, 2 * block_n), right = uniform(0, 1) ? 0 : uniform(0, 300);
    auto const windowed = TailBalancedScheduler::to_params(m_blocks, nheads, batch, num_sms, seqlen_q, seqlen_k,
                                                           block_m, block_n, left, right);
    if (!covers_once<TailBalancedScheduler>(windowed, num_sms, "dealt order, windowed")) { return 1; }
    for (int per_round = 1; per_round <= 2; ++per_round) {
      if (per_round == 2 && m_blocks * nheads * batch <= num_sms) { continue; }
      auto const order = Snake::to_params(m_blocks, nheads, batch, num_sms, per_round);
      if (!covers_once<Snake>(order, num_sms, per_round == 1 ? "snake" : "pairs")) { return 1; }
    }
    if (!covers_once<Strided>(Strided::to_params(m_blocks, nheads, batch, num_sms), num_sms, "strided")) { return 1; }
    ++checked;
  }
  // The choice: 2 x 8 heads of 1243 rows (160 tiles of 128 rows over 132 SMs) leave the
  // snake 28 CTAs with a second tile (1.5x the balanced time in the host's model): pairs.
  // 2 x 40 heads of 2100 rows (17 tiles per head): the snake with a dealt tail.
  auto const uneven = TailBalancedScheduler::to_params(10, 8, 2, 132, 1243, 1243, 128, 128);
  auto const even = TailBalancedScheduler::to_params(17, 40, 2, 132, 2100, 2100, 128, 128);
  auto const few = TailBalancedScheduler::to_params(8, 16, 1, 132, 1000, 1000, 128, 128);
  if (uneven.per_round != 2 || even.per_round != 1 || even.tail_begin >= even.num_tiles || few.per_round != 1) {
    std::printf("FAIL choice: 1243 x 16 per_round %d (want 2), 2100 x 80 per_round %d tail_begin %d of %d (want 1, "
                "a dealt tail), 1000 x 16 per_round %d (want 1)\n",
                uneven.per_round, even.per_round, even.tail_begin, even.num_tiles, few.per_round);
    return 1;
  }
  // A causal window, (seqlen_k, 0), is the causal model: the same choice and deal.
  auto const causal_window = TailBalancedScheduler::to_params(17, 40, 2, 132, 2100, 2100, 128, 128, 2100, 0);
  auto const causal_plain = TailBalancedScheduler::to_params(17, 40, 2, 132, 2100, 2100, 128, 128);
  if (causal_window.per_round != causal_plain.per_round || causal_window.tail_begin != causal_plain.tail_begin ||
      std::memcmp(causal_window.tail, causal_plain.tail, sizeof(causal_plain.tail)) != 0) {
    std::printf("FAIL the window (2100, 0) on 2100 rows schedules unlike causal\n");
    return 1;
  }
  std::printf("ok %d shapes (%d in pairs)\n", checked, paired);
  return 0;
}
