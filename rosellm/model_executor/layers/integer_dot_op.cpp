// The integer kernel's `linear` (integer_dot.c) as a torch operator, so that a compiled graph calls it as it
// calls torch's own operators, without going back into Python. It holds no arithmetic: it checks its inputs,
// makes the output and calls the C kernel through the address the graph passes (the library built for this
// CPU's level, loaded by ctypes). NAMESPACE is defined by the build: each copy of the package has its own.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

// integer_dot.c's `linear`: out [rows, out_features] = x [rows, in] @ w.T + bias, 0 or -1 (no memory).
using linear_kernel = int (*)(int bits, const float *x, const void *w, const float *w_scales,
                              const float *w_minimums, const float *bias, float *out, int64_t rows,
                              int64_t out_features, int64_t in, int threads);

const float *pointer_or_null(const std::optional<at::Tensor> &t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// x [rows, in] fp32; codes [out, in / 2] uint8 (4 bits) or [out, in] int8 (8 bits); scales, minimums
// [out, in / 32] fp32 (minimums for 4 bits only); bias [out] fp32 -> [rows, out] fp32.
at::Tensor integer_dot_linear(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scales,
                              const std::optional<at::Tensor> &minimums, const std::optional<at::Tensor> &bias,
                              int64_t kernel) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "integer_dot_linear takes x [rows, in] fp32");
  const bool four_bits = codes.scalar_type() == at::kByte;
  TORCH_CHECK(four_bits == minimums.has_value(), "4-bit codes take minimums, 8-bit codes none");
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options());
  const int status = reinterpret_cast<linear_kernel>(kernel)(
      four_bits ? 4 : 8, rows.data_ptr<float>(), codes.data_ptr(), scales.data_ptr<float>(),
      pointer_or_null(minimums), pointer_or_null(bias), out.data_ptr<float>(), x.size(0), codes.size(0), x.size(1),
      at::get_num_threads());
  TORCH_CHECK(status == 0, "no memory for the 8-bit copy of the activations");
  return out;
}

}  // namespace

#define DEFINE_IN(ns) TORCH_LIBRARY_FRAGMENT(ns, library)  // expands NAMESPACE before the macro pastes it
DEFINE_IN(NAMESPACE) {
  library.def(
      "integer_dot_linear(Tensor x, Tensor codes, Tensor scales, Tensor? minimums, Tensor? bias, int kernel) "
      "-> Tensor");
  library.impl("integer_dot_linear", c10::DispatchKey::CPU, &integer_dot_linear);
}
