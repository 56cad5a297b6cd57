// Host check of the mask policies' tile arithmetic (csrc/flash3/mask.h) against brute
// force, for random lengths, windows and tile sizes: the key tiles a query tile visits,
// the query tiles a key tile visits (the same relation: the deterministic backward's dQ
// turns count on it), the tiles that may skip the element-wise mask, and each row's
// visible keys. Built and run by tests/test_mask_policy.py; prints "ok" and the number
// of cases, or the first failure.
#include <cstdio>
#include <cstdlib>
#include <random>

#include "flash3/mask.h"

namespace {

struct Problem {
  int seqlen_q, seqlen_k, left, right;  // left/right: the clamped window (>= 0)
  bool causal;                          // the causal mask instead of the window
};

// FlashAttention's bottom-right-aligned masks, element by element.
bool visible(Problem const& p, int i, int j) {
  if (i < 0 || i >= p.seqlen_q || j < 0 || j >= p.seqlen_k) { return false; }
  int const offset = p.seqlen_k - p.seqlen_q;
  if (p.causal) { return j <= i + offset; }
  return j >= i + offset - p.left && j <= i + offset + p.right;
}

bool tile_visible(Problem const& p, int m, int n, int bm, int bn) {
  for (int i = m * bm; i < (m + 1) * bm; ++i) {
    for (int j = n * bn; j < (n + 1) * bn; ++j) {
      if (visible(p, i, j)) { return true; }
    }
  }
  return false;
}

int failures = 0;
#define EXPECT(cond, ...)                                                   \
  do {                                                                      \
    if (!(cond)) {                                                          \
      if (failures++ < 10) {                                                \
        std::printf("FAIL %s (sq=%d sk=%d left=%d right=%d causal=%d): ", #cond, p.seqlen_q, p.seqlen_k, p.left, \
                    p.right, int(p.causal));                                \
        std::printf(__VA_ARGS__);                                           \
        std::printf("\n");                                                  \
      }                                                                     \
    }                                                                       \
  } while (0)

template <class Mask, int kBlockM, int kBlockN>
void check(Problem const& p) {
  flash3::MaskPolicy<Mask, kBlockM, kBlockN> const policy{p.seqlen_q, p.seqlen_k, p.left, p.right};
  int const m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
  int const n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
  for (int m = 0; m < m_blocks; ++m) {
    int const begin = policy.n_block_begin(m), end = policy.n_block_end(m);
    for (int n = 0; n < n_blocks; ++n) {
      bool const in_range = n >= begin && n < end;
      bool const seen = tile_visible(p, m, n, kBlockM, kBlockN);
      if (Mask::kIsLocal) {
        EXPECT(in_range == seen, "m=%d n=%d range [%d, %d) tile visible %d", m, n, begin, end, int(seen));
      } else {
        EXPECT(!seen || in_range, "m=%d n=%d range [%d, %d) misses a visible tile", m, n, begin, end);
      }
      if (in_range && !policy.needs_mask(m, n)) {
        // Every element of the tile, rows past seqlen_q included, is visible.
        for (int i = m * kBlockM; i < (m + 1) * kBlockM; ++i) {
          for (int j = n * kBlockN; j < (n + 1) * kBlockN; ++j) {
            bool const v = j < p.seqlen_k && (p.causal ? j <= i + p.seqlen_k - p.seqlen_q
                                                       : !Mask::kIsLocal || (j >= i + p.seqlen_k - p.seqlen_q - p.left &&
                                                                             j <= i + p.seqlen_k - p.seqlen_q + p.right));
            EXPECT(v, "m=%d n=%d skips the mask but (%d, %d) is masked", m, n, i, j);
          }
        }
      }
    }
  }
  if constexpr (Mask::kIsLocal) {
    for (int n = 0; n < n_blocks; ++n) {
      int const begin = policy.m_block_begin(n), end = policy.m_block_end(n);
      for (int m = 0; m < m_blocks; ++m) {
        bool const in_range = m >= begin && m < end;
        EXPECT(in_range == tile_visible(p, m, n, kBlockM, kBlockN), "n=%d m=%d query range [%d, %d)", n, m, begin, end);
      }
    }
  }
  for (int i = 0; i < p.seqlen_q; ++i) {
    for (int j = 0; j < p.seqlen_k; ++j) {
      bool const v = j >= policy.key_begin(i) && j < policy.key_end(i);
      EXPECT(v == visible(p, i, j), "row %d key %d: [%d, %d)", i, j, policy.key_begin(i), policy.key_end(i));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int const cases = argc > 1 ? std::atoi(argv[1]) : 3000;
  std::mt19937 rng(1234);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int c = 0; c < cases; ++c) {
    Problem p;
    p.seqlen_q = uniform(1, 400);
    p.seqlen_k = uniform(1, 400);
    // A window side: small, around the tile sizes, or unbounded (clamped as the binding does).
    auto side = [&](int unbounded) {
      int const kind = uniform(0, 3);
      return kind == 0 ? uniform(0, 3) : kind == 1 ? uniform(0, 200) : kind == 2 ? uniform(60, 140) : unbounded;
    };
    p.left = side(p.seqlen_k);
    p.right = side(p.seqlen_q);
    p.causal = false;
    check<flash3::LocalMask, 128, 128>(p);
    check<flash3::LocalMask, 64, 112>(p);
    check<flash3::LocalMask, 128, 80>(p);
    check<flash3::LocalMask, 192, 176>(p);
    p.causal = true;
    check<flash3::CausalMask, 128, 128>(p);
    check<flash3::CausalMask, 64, 112>(p);
  }
  if (failures > 0) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok %d cases\n", cases);
  return 0;
}
