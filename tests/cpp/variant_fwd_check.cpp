// Host check of the forward's variant choice (csrc/flash3/variant_fwd.h) against the
// rules it states: the 16-bit short tile runs where both lengths are at most its reach,
// or, for the local mask, where the window spans at most that many keys; of several FP8
// variants, the one with the largest lower bound on seqlen_k, then the smallest upper
// bound. Built and run by tests/test_variant_fwd.py; prints "ok" and the number of cases,
// or the first failure.
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <random>
#include <vector>

#include "flash3/variant_fwd.h"

namespace {

using flash3::FwdVariantBounds;

struct Entry {
  int id;
  bool usable;
  FwdVariantBounds bounds;
};

// The 16-bit rule as stated: short where both lengths are short, or the window is.
bool short_expected(int seqlen_q, int seqlen_k, bool local, int left, int right, int reach) {
  return (seqlen_q <= reach && seqlen_k <= reach) || (local && int64_t(left) + right + 1 <= reach);
}

// The FP8 table's rule as stated, by brute force: the largest min_seqlen_k, then the
// smallest max_seqlen_k, the first entry on a tie.
int table_expected(std::vector<Entry> const& table, int seqlen_k) {
  int best = -1;
  for (int i = 0; i < int(table.size()); ++i) {
    Entry const& e = table[i];
    if (!e.usable || seqlen_k < e.bounds.min_seqlen_k || seqlen_k > e.bounds.max_seqlen_k) { continue; }
    if (best < 0) { best = i; continue; }
    FwdVariantBounds const& b = table[best].bounds;
    if (e.bounds.min_seqlen_k > b.min_seqlen_k ||
        (e.bounds.min_seqlen_k == b.min_seqlen_k && e.bounds.max_seqlen_k < b.max_seqlen_k)) {
      best = i;
    }
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int const rounds = argc > 1 ? std::atoi(argv[1]) : 1000;
  std::mt19937 rng(20261205);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  long cases = 0;
  for (int round = 0; round < rounds; ++round) {
    // The 16-bit kernels: a general tile and a short one of reach 512, 1024 or 2048.
    int const reach = 512 << uniform(0, 2);
    Entry const variants[] = {{0, true, FwdVariantBounds{}}, {1, true, flash3::short_seq_bounds(reach)}};
    for (int c = 0; c < 200; ++c, ++cases) {
      int const seqlen_q = uniform(0, 3) == 0 ? uniform(reach - 2, reach + 2) : uniform(0, 3 * reach);
      int const seqlen_k = uniform(0, 3) == 0 ? uniform(reach - 2, reach + 2) : uniform(0, 3 * reach);
      bool const local = uniform(0, 1);
      int const left = uniform(0, 1) ? uniform(0, 2 * reach) : uniform(0, 1 << 30);
      int const right = uniform(0, 1) ? uniform(0, reach) : uniform(0, 1 << 30);
      flash3::FwdVariantLengths const lengths =
          local ? flash3::local_variant_lengths(seqlen_q, seqlen_k, left, right, reach)
                : flash3::FwdVariantLengths{seqlen_q, seqlen_k};
      Entry const* chosen = flash3::pick_fwd_variant(std::begin(variants), std::end(variants), lengths.seqlen_q,
                                                     lengths.seqlen_k, [](Entry const&) { return true; });
      bool const expected = short_expected(seqlen_q, seqlen_k, local, left, right, reach);
      if (chosen == nullptr || (chosen->id == 1) != expected) {
        std::printf("FAIL 16-bit: seqlen_q %d seqlen_k %d local %d window (%d, %d) reach %d: chose %d\n", seqlen_q,
                    seqlen_k, int(local), left, right, reach, chosen ? chosen->id : -1);
        return 1;
      }
    }
    // An FP8-style table: random seqlen_k ranges, some entries not built.
    std::vector<Entry> table;
    int const entries = uniform(1, 6);
    for (int i = 0; i < entries; ++i) {
      FwdVariantBounds b{};
      if (uniform(0, 1)) { b.min_seqlen_k = uniform(0, 4) * 1024; }
      if (uniform(0, 1)) { b.max_seqlen_k = b.min_seqlen_k + uniform(0, 8) * 1024 - uniform(0, 1); }
      table.push_back({i, uniform(0, 5) != 0, b});
    }
    for (int c = 0; c < 200; ++c, ++cases) {
      int const seqlen_k = uniform(0, 12 * 1024);
      int const seqlen_q = uniform(0, 12 * 1024);
      Entry const* chosen = flash3::pick_fwd_variant(table.data(), table.data() + table.size(), seqlen_q, seqlen_k,
                                                     [](Entry const& e) { return e.usable; });
      int const expected = table_expected(table, seqlen_k);
      if ((chosen ? chosen->id : -1) != expected) {
        std::printf("FAIL table: seqlen_k %d: chose %d, expected %d\n", seqlen_k, chosen ? chosen->id : -1, expected);
        return 1;
      }
    }
  }
  std::printf("ok %ld cases\n", cases);
  return 0;
}
