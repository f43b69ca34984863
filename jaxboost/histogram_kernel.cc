// Histogram kernel for XLA on CPU (an XLA FFI custom call).
//
// Sums gradients and Hessians per (node, feature, bin) over the rows selected by a row mask,
// skipping the other rows, so that the smaller child of each split costs only its own rows.
// Rows are taken in blocks: a block's selected rows are first gathered without branches (row
// id, histogram offset of its node, gradient, Hessian), then each selected row adds to all its
// features; the features of one row hit different cells, so the additions do not wait on each
// other. The codes are feature-major, but a block's rows reuse the same cache lines of every
// feature. Threads, when asked for, each take a range of features (disjoint cells, no reduction).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlockRows = 2048;
// Every uint8 code has a slot, so a code past max_bin cannot write outside the buffer.
constexpr int64_t kCodeSlots = 256;

// Adds the selected rows of a block to features [feature_begin, feature_end).
void AccumulateBlock(const uint8_t* codes, int64_t n_rows, int64_t feature_begin, int64_t feature_end,
                     const int64_t* rows, const int64_t* node_offsets, const float* pairs, int64_t count,
                     float* hist) {
  for (int64_t j = 0; j < count; ++j) {
    float* node_hist = hist + node_offsets[j];
    const uint8_t* row_codes = codes + rows[j];
    const float g = pairs[2 * j], h = pairs[2 * j + 1];
    for (int64_t f = feature_begin; f < feature_end; ++f) {
      float* cell = node_hist + f * kCodeSlots * 2 + 2 * static_cast<int64_t>(row_codes[f * n_rows]);
      cell[0] += g;
      cell[1] += h;
    }
  }
}

struct HistogramProblem {
  const uint8_t* codes;
  const int32_t* node_of_row;
  const float* gradients;
  const float* hessians;
  const bool* row_mask;  // nullptr: every row
  int64_t n_rows, n_features, num_nodes;
  float* hist;  // (num_nodes, n_features, kCodeSlots, 2), zeroed
};

// One thread's share: all selected rows, features [feature_begin, feature_end), so threads
// write disjoint cells and need no reduction.
void AccumulateFeatures(const HistogramProblem& p, int64_t feature_begin, int64_t feature_end) {
  const int64_t node_stride = p.n_features * kCodeSlots * 2;
  std::vector<int64_t> rows(kBlockRows), node_offsets(kBlockRows);
  std::vector<float> pairs(2 * kBlockRows);
  for (int64_t start = 0; start < p.n_rows; start += kBlockRows) {
    const int64_t stop = std::min(p.n_rows, start + kBlockRows);
    int64_t count = 0;
    for (int64_t i = start; i < stop; ++i) {
      // Branch-free gathering: every row is written, only selected rows advance the count.
      const int32_t node = p.node_of_row[i];
      const bool take = (p.row_mask == nullptr || p.row_mask[i]) && node >= 0 && node < p.num_nodes;
      rows[count] = i;
      node_offsets[count] = static_cast<int64_t>(node) * node_stride;
      pairs[2 * count] = p.gradients[i];
      pairs[2 * count + 1] = p.hessians[i];
      count += take;
    }
    AccumulateBlock(p.codes, p.n_rows, feature_begin, feature_end, rows.data(), node_offsets.data(), pairs.data(),
                    count, p.hist);
  }
}

void BuildHistogram(HistogramProblem problem, int64_t max_bin, int64_t threads, float* out) {
  const int64_t node_stride = problem.n_features * kCodeSlots * 2;
  const size_t cells = static_cast<size_t>(problem.num_nodes * node_stride);
  // With fewer than 256 bins, sums go to a scratch buffer with a slot for every code first.
  std::vector<float> scratch;
  if (max_bin != kCodeSlots) {
    scratch.assign(cells, 0.0f);
    problem.hist = scratch.data();
  } else {
    std::memset(out, 0, sizeof(float) * cells);
    problem.hist = out;
  }
  threads = std::max<int64_t>(1, std::min(threads, problem.n_features));
  if (threads == 1) {
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
  for (int64_t node = 0; node < problem.num_nodes; ++node) {
    for (int64_t f = 0; f < problem.n_features; ++f) {
      const float* source = problem.hist + node * node_stride + f * kCodeSlots * 2;
      std::memcpy(out + (node * problem.n_features + f) * max_bin * 2, source, sizeof(float) * 2 * max_bin);
    }
  }
}

ffi::Error HistogramImpl(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::S32> node_of_row,
                         ffi::Buffer<ffi::F32> gradients, ffi::Buffer<ffi::F32> hessians,
                         ffi::Buffer<ffi::PRED> row_mask, int64_t threads,
                         ffi::ResultBuffer<ffi::F32> histogram) {
  const auto code_dims = codes.dimensions();
  const auto out_dims = histogram->dimensions();
  if (code_dims.size() != 2 || out_dims.size() != 4) {
    return ffi::Error::InvalidArgument("histogram kernel: codes must be 2-D and the histogram 4-D");
  }
  const int64_t n_features = code_dims[0], n_rows = code_dims[1];
  const int64_t num_nodes = out_dims[0], max_bin = out_dims[2];
  if (out_dims[1] != n_features || out_dims[3] != 2 || max_bin > kCodeSlots ||
      static_cast<int64_t>(node_of_row.element_count()) != n_rows ||
      static_cast<int64_t>(gradients.element_count()) != n_rows ||
      static_cast<int64_t>(hessians.element_count()) != n_rows) {
    return ffi::Error::InvalidArgument("histogram kernel: inconsistent shapes");
  }
  const int64_t mask_size = static_cast<int64_t>(row_mask.element_count());
  if (mask_size != 0 && mask_size != n_rows) {
    return ffi::Error::InvalidArgument("histogram kernel: the row mask must be empty or one flag per row");
  }
  const bool* mask = mask_size == 0 ? nullptr : row_mask.typed_data();
  const HistogramProblem problem{codes.typed_data(), node_of_row.typed_data(), gradients.typed_data(),
                                 hessians.typed_data(), mask, n_rows, n_features, num_nodes, nullptr};
  BuildHistogram(problem, max_bin, threads, histogram->typed_data());
  return ffi::Error::Success();
}

struct SplitsOfLevel {
  const int32_t* feature;
  const int32_t* threshold_bin;
  const bool* default_left;
  const bool* splits;
  const bool* left_is_smaller;
  int64_t num_nodes;
  int64_t missing_bin;
};

// Rows [row_begin, row_end): the child of each row (2 * node + goes_right, as the grower numbers
// the next level) and whether the row is in the smaller child of a node that splits.
void RouteRows(const uint8_t* codes, int64_t n_rows, const int32_t* node_of_row, const SplitsOfLevel& level,
               int64_t row_begin, int64_t row_end, int32_t* child_of_row, bool* in_smaller_child) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    const int32_t node = node_of_row[i];
    const bool in_range = node >= 0 && node < level.num_nodes;
    const int32_t safe_node = in_range ? node : 0;
    const int64_t code = codes[static_cast<int64_t>(level.feature[safe_node]) * n_rows + i];
    const bool goes_right = code == level.missing_bin ? !level.default_left[safe_node]
                                                      : code > level.threshold_bin[safe_node];
    child_of_row[i] = 2 * node + static_cast<int32_t>(goes_right);
    in_smaller_child[i] = in_range && level.splits[safe_node] && (goes_right != level.left_is_smaller[safe_node]);
  }
}

ffi::Error RouteHistogramImpl(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::S32> node_of_row,
                              ffi::Buffer<ffi::F32> gradients, ffi::Buffer<ffi::F32> hessians,
                              ffi::Buffer<ffi::S32> feature, ffi::Buffer<ffi::S32> threshold_bin,
                              ffi::Buffer<ffi::PRED> default_left, ffi::Buffer<ffi::PRED> splits,
                              ffi::Buffer<ffi::PRED> left_is_smaller, int64_t missing_bin, int64_t threads,
                              ffi::ResultBuffer<ffi::S32> child_of_row, ffi::ResultBuffer<ffi::F32> histogram) {
  const auto code_dims = codes.dimensions();
  const auto out_dims = histogram->dimensions();
  if (code_dims.size() != 2 || out_dims.size() != 4) {
    return ffi::Error::InvalidArgument("route kernel: codes must be 2-D and the histogram 4-D");
  }
  const int64_t n_features = code_dims[0], n_rows = code_dims[1];
  const int64_t num_nodes = out_dims[0], max_bin = out_dims[2];
  const int64_t per_node[] = {static_cast<int64_t>(feature.element_count()),
                              static_cast<int64_t>(threshold_bin.element_count()),
                              static_cast<int64_t>(default_left.element_count()),
                              static_cast<int64_t>(splits.element_count()),
                              static_cast<int64_t>(left_is_smaller.element_count())};
  for (int64_t count : per_node) {
    if (count != num_nodes) return ffi::Error::InvalidArgument("route kernel: one split per node expected");
  }
  if (out_dims[1] != n_features || out_dims[3] != 2 || max_bin > kCodeSlots ||
      static_cast<int64_t>(node_of_row.element_count()) != n_rows ||
      static_cast<int64_t>(child_of_row->element_count()) != n_rows ||
      static_cast<int64_t>(gradients.element_count()) != n_rows ||
      static_cast<int64_t>(hessians.element_count()) != n_rows) {
    return ffi::Error::InvalidArgument("route kernel: inconsistent shapes");
  }
  // Nodes that do not split may carry any feature: clamp it so that reading a code stays in bounds.
  std::vector<int32_t> safe_feature(static_cast<size_t>(num_nodes));
  for (int64_t node = 0; node < num_nodes; ++node) {
    safe_feature[node] = static_cast<int32_t>(
        std::min<int64_t>(std::max<int64_t>(feature.typed_data()[node], 0), std::max<int64_t>(n_features - 1, 0)));
  }
  if (n_features == 0) return ffi::Error::InvalidArgument("route kernel: no features");
  const SplitsOfLevel level{safe_feature.data(), threshold_bin.typed_data(), default_left.typed_data(),
                            splits.typed_data(), left_is_smaller.typed_data(), num_nodes, missing_bin};
  std::unique_ptr<bool[]> in_smaller_child(new bool[static_cast<size_t>(std::max<int64_t>(n_rows, 1))]);
  threads = std::max<int64_t>(1, threads);
  const int64_t route_threads = std::min<int64_t>(threads, std::max<int64_t>(1, n_rows / kBlockRows));
  if (route_threads == 1) {
    RouteRows(codes.typed_data(), n_rows, node_of_row.typed_data(), level, 0, n_rows, child_of_row->typed_data(),
              in_smaller_child.get());
  } else {
    std::vector<std::thread> workers;
    for (int64_t t = 0; t < route_threads; ++t) {
      workers.emplace_back(RouteRows, codes.typed_data(), n_rows, node_of_row.typed_data(), std::cref(level),
                           t * n_rows / route_threads, (t + 1) * n_rows / route_threads, child_of_row->typed_data(),
                           in_smaller_child.get());
    }
    for (auto& worker : workers) worker.join();
  }
  const HistogramProblem problem{codes.typed_data(), node_of_row.typed_data(), gradients.typed_data(),
                                 hessians.typed_data(), in_smaller_child.get(), n_rows, n_features, num_nodes, nullptr};
  BuildHistogram(problem, max_bin, threads, histogram->typed_data());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kRouteHistogramHandler, RouteHistogramImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::U8>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Attr<int64_t>("missing_bin")
                           .Attr<int64_t>("threads")
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER(kHistogramHandler, HistogramImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::U8>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::PRED>>()
                           .Attr<int64_t>("threads")
                           .Ret<ffi::Buffer<ffi::F32>>());

// Prediction on raw features: every row walks every tree (rounds x outputs) of the heap layout
// and adds the leaf value to its raw prediction, round after round in float32 (the order the
// training loop uses). A row goes left when x < threshold, the bin edge of the split (exactly
// "bin <= threshold_bin"), and NaN follows the node's default direction, so no binning is
// needed. ``packed`` holds feature << 10 | threshold_bin << 2 | default_left << 1 | is_leaf.
ffi::Error PredictImpl(ffi::Buffer<ffi::F32> features, ffi::Buffer<ffi::S32> packed, ffi::Buffer<ffi::F32> thresholds,
                       ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::F32> initial, ffi::ResultBuffer<ffi::F32> raw) {
  const auto feature_dims = features.dimensions();
  const auto tree_dims = packed.dimensions();
  if (feature_dims.size() != 2 || tree_dims.size() != 3) {
    return ffi::Error::InvalidArgument("predict kernel: X (n, d), trees (rounds, outputs, nodes) expected");
  }
  const int64_t n_rows = feature_dims[0], n_features = feature_dims[1];
  const int64_t rounds = tree_dims[0], outputs = tree_dims[1], nodes = tree_dims[2];
  if (static_cast<int64_t>(values.element_count()) != rounds * outputs * nodes ||
      static_cast<int64_t>(thresholds.element_count()) != rounds * outputs * nodes ||
      static_cast<int64_t>(initial.element_count()) != n_rows * outputs ||
      static_cast<int64_t>(raw->element_count()) != n_rows * outputs) {
    return ffi::Error::InvalidArgument("predict kernel: inconsistent shapes");
  }
  if (n_features == 0) return ffi::Error::InvalidArgument("predict kernel: no features");
  const float* x = features.typed_data();
  const int32_t* node_info = packed.typed_data();
  const float* split_at = thresholds.typed_data();
  const float* leaf_values = values.typed_data();
  float* out = raw->typed_data();
  std::copy(initial.typed_data(), initial.typed_data() + n_rows * outputs, out);
  int64_t depth = 0;
  while ((int64_t{2} << depth) - 1 < nodes) ++depth;  // nodes = 2^(depth+1) - 1
  // Checked once here, so the walk itself needs no bounds checks.
  if ((int64_t{2} << depth) - 1 != nodes) return ffi::Error::InvalidArgument("predict kernel: not a full heap");
  for (int64_t i = 0; i < rounds * outputs * nodes; ++i) {
    const int64_t feature = node_info[i] >> 10;
    if ((node_info[i] & 1) == 0 && (feature < 0 || feature >= n_features)) {
      return ffi::Error::InvalidArgument("predict kernel: split feature out of range");
    }
  }
  // Blocks of rows walk one tree together, a fixed number of levels with no data-dependent
  // branch (a leaf keeps its row), so the independent rows overlap in the pipeline.
  constexpr int64_t kPredictBlock = 16;
  int64_t node_of[kPredictBlock];
  for (int64_t first = 0; first < n_rows; first += kPredictBlock) {
    const int64_t block = std::min<int64_t>(kPredictBlock, n_rows - first);
    for (int64_t tree = 0; tree < rounds * outputs; ++tree) {
      const int32_t* info = node_info + tree * nodes;
      const float* threshold = split_at + tree * nodes;
      for (int64_t r = 0; r < block; ++r) node_of[r] = 0;
      for (int64_t level = 0; level < depth; ++level) {
        for (int64_t r = 0; r < block; ++r) {
          const int64_t node = node_of[r];
          const int32_t word = info[node];
          const float value = x[(first + r) * n_features + (word >> 10)];
          // NaN fails every comparison: it goes right unless the node sends missing values left.
          const bool goes_right = value != value ? (word & 2) == 0 : !(value < threshold[node]);
          // Leaves keep their row; a leaf on the last level never reaches this line.
          node_of[r] = (word & 1) ? node : 2 * node + 1 + static_cast<int64_t>(goes_right);
        }
      }
      const int64_t output = tree % outputs;
      for (int64_t r = 0; r < block; ++r) out[(first + r) * outputs + output] += leaf_values[tree * nodes + node_of[r]];
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kPredictHandler, PredictImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

}  // namespace

extern "C" XLA_FFI_Error* JaxboostHistogram(XLA_FFI_CallFrame* call_frame) {
  return kHistogramHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostRouteHistogram(XLA_FFI_CallFrame* call_frame) {
  return kRouteHistogramHandler(call_frame);
}

extern "C" XLA_FFI_Error* JaxboostPredict(XLA_FFI_CallFrame* call_frame) {
  return kPredictHandler(call_frame);
}
