// Host check of the mask policies' tile arithmetic (csrc/flash3/mask.h) against brute
// force, for random lengths, windows and tile sizes: the key tiles a query tile visits,
// the query tiles a key tile visits (the same relation: the deterministic backward's dQ
// turns count on it), the tiles that may skip the element-wise mask (and the backward's
// masked prefix of a key tile's query tiles), and each row's
// visible keys. Built and run by tests/test_mask_policy.py; prints "ok" and the number
// of cases, or the first failure. Also the forward's generalisations: several rows per
// query (GQA-packed rows) and keys past those read that count for the alignment.
#include <cstdio>
#include <cstdlib>
#include <random>

#include "flash3/mask.h"

namespace {

struct Problem {
  int seqlen_q, seqlen_k, left, right;  // left/right: the clamped window (>= 0)
  bool causal;                          // the causal mask instead of the window
  int group = 1;                        // rows per query (seqlen_q rows: seqlen_q / group queries)
  int keys_after = 0;                   // keys past seqlen_k that count for the alignment
  int offset() const { return seqlen_k + keys_after - seqlen_q / group; }
};

// FlashAttention's bottom-right-aligned masks, element by element; rows past seqlen_q
// as the kernels see them (their query continues the count).
bool visible_any_row(Problem const& p, int i, int j) {
  if (j < 0 || j >= p.seqlen_k) { return false; }
  int const query = i / p.group;
  if (p.causal) { return j <= query + p.offset(); }
  return j >= query + p.offset() - p.left && j <= query + p.offset() + p.right;
}

bool visible(Problem const& p, int i, int j) { return i >= 0 && i < p.seqlen_q && visible_any_row(p, i, j); }

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
        std::printf("FAIL %s (sq=%d sk=%d left=%d right=%d causal=%d group=%d after=%d): ", #cond, p.seqlen_q, \
                    p.seqlen_k, p.left, p.right, int(p.causal), p.group, p.keys_after); \
        std::printf(__VA_ARGS__);                                           \
        std::printf("\n");                                                  \
      }                                                                     \
    }                                                                       \
  } while (0)

template <class Mask, int kBlockM, int kBlockN>
void check(Problem const& p) {
  flash3::MaskPolicy<Mask, kBlockM, kBlockN> const policy{p.seqlen_q, p.seqlen_k, p.left, p.right, p.offset(),
                                                          flash3::RowsPerQuery::of(p.group)};
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
            bool const v = (p.causal || Mask::kIsLocal) ? visible_any_row(p, i, j) : j < p.seqlen_k;
            EXPECT(v, "m=%d n=%d skips the mask but (%d, %d) is masked", m, n, i, j);
          }
        }
      }
    }
    // The forward's loop without the mask's code (mainloop_fwd.h) walks [begin, unmasked_end):
    // the tiles below the last one are unmasked exactly there (causal, no mask).
    if constexpr (!Mask::kIsLocal) {
      if (end > begin) {
        int const unmasked_end = policy.unmasked_end(m, begin, end);
        EXPECT(unmasked_end >= begin && unmasked_end <= end - 1, "m=%d unmasked_end %d of [%d, %d)", m, unmasked_end,
               begin, end);
        for (int n = begin; n < end - 1; ++n) {
          EXPECT((n < unmasked_end) == !policy.needs_mask(m, n), "m=%d n=%d masked %d, unmasked_end %d of [%d, %d)", m,
                 n, int(policy.needs_mask(m, n)), unmasked_end, begin, end);
        }
      }
    }
  }
  if constexpr (!Mask::kIsLocal) {
    // The backward's split loop (mainloop_bwd_split_keys.h) walks a key tile's query tiles
    // upwards from any first one, the masked_prefix of them with the mask's code and the
    // rest without it: those are masked exactly there.
    for (int n = 0; n < (p.group == 1 && p.keys_after == 0 ? n_blocks : 0); ++n) {
      for (int m_begin = 0; m_begin < m_blocks; ++m_begin) {
        int const t = policy.masked_prefix(n, m_begin, m_blocks);
        EXPECT(t >= 0 && m_begin + t <= m_blocks, "n=%d masked_prefix %d from %d of %d", n, t, m_begin, m_blocks);
        for (int m = m_begin; m < m_blocks; ++m) {
          EXPECT((m < m_begin + t) == policy.needs_mask(m, n), "n=%d m=%d masked %d, prefix %d from %d", n, m,
                 int(policy.needs_mask(m, n)), t, m_begin);
        }
      }
    }
  }
  if constexpr (Mask::kIsLocal) {
    // The backward's ranges (one row per query, no keys past those read).
    for (int n = 0; n < (p.group == 1 && p.keys_after == 0 ? n_blocks : 0); ++n) {
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

// The rows' division by rows_per_query (mask.h RowsPerQuery) against the integer division:
// every divisor up to 1024 over the rows a tile can have, then random rows up to 2^31 - 1
// and large divisors.
void check_rows_per_query(std::mt19937& rng) {
  std::uniform_int_distribution<int> any_row(0, 0x7fffffff);
  auto check_one = [&](int d, int row) {
    Problem const p{};
    int const got = flash3::RowsPerQuery::of(d).divide(row);
    EXPECT(got == row / d, "RowsPerQuery::of(%d).divide(%d) = %d, not %d", d, row, got, row / d);
  };
  for (int d = 1; d <= 1024; ++d) {
    for (int row = 0; row < 4 * 1024; ++row) { check_one(d, row); }
    for (int i = 0; i < 64; ++i) { check_one(d, any_row(rng)); }
    check_one(d, 0x7fffffff);
  }
  for (int d : {4095, 65536, 1000003, (1 << 30) + 7, 0x7fffffff}) {
    for (int i = 0; i < 4096; ++i) { check_one(d, any_row(rng)); }
    check_one(d, 0x7fffffff);
    check_one(d, d - 1);
    check_one(d, d);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int const cases = argc > 1 ? std::atoi(argv[1]) : 3000;
  std::mt19937 rng(1234);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  check_rows_per_query(rng);
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
    // GQA-packed rows and keys past those read (split-KV parts of the KV-cache call).
    p.group = uniform(1, 8);
    p.seqlen_q = p.group * uniform(1, 48);
    p.keys_after = uniform(0, 2) == 0 ? 0 : uniform(0, 300);
    p.left = side(p.seqlen_k + p.keys_after);
    p.right = side(p.seqlen_q);
    check<flash3::CausalMask, 128, 176>(p);
    check<flash3::CausalMask, 64, 128>(p);
    p.causal = false;
    check<flash3::LocalMask, 128, 176>(p);
    check<flash3::LocalMask, 64, 128>(p);
  }
  if (failures > 0) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok %d cases\n", cases);
  return 0;
}
