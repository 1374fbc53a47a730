// One DmSGD step for n nodes stacked on the leading axis, with a circulant mixing matrix,
// in place: m <- beta m + g;  x <- w_self (x - lr m) + sum_k w_k roll(x - lr m, -s_k).
//
// XLA:CPU runs this step far below memory bandwidth (the mixing reads each row at several
// offsets, recomputes the local step for each, and writes a fresh buffer that is then copied
// into the donated params). Here the columns are cut into blocks of `block` floats: for one
// block, the local step of every node goes to a small scratch buffer that stays in cache, and
// the mixed rows are written straight back over x. Each of x, m, g is read once and x, m are
// written once: the five passes the step needs. Built at first use by gossipjax/_native.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error CirculantDmsgd(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> g,
                                 ffi::Buffer<ffi::F32> hyper, ffi::Span<const int64_t> shifts,
                                 ffi::Span<const float> weights, float self_weight, int64_t block,
                                 ffi::ResultBuffer<ffi::F32> x_out, ffi::ResultBuffer<ffi::F32> m_out) {
  if (x.dimensions().size() < 1) return ffi::Error::InvalidArgument("params need a leading node axis");
  if (m.element_count() != x.element_count() || g.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("params, momentum and grads differ in size");
  if (hyper.element_count() != 2) return ffi::Error::InvalidArgument("hyper must be [learning_rate, beta]");
  if (shifts.size() != weights.size()) return ffi::Error::InvalidArgument("one weight per shift");
  if (block < 1) return ffi::Error::InvalidArgument("block must be positive");
  const int64_t n = x.dimensions()[0];
  if (n == 0) return ffi::Error::Success();
  const int64_t d = x.element_count() / n;
  const float lr = hyper.typed_data()[0], beta = hyper.typed_data()[1];
  const float* xp = x.typed_data();
  const float* mp = m.typed_data();
  const float* gp = g.typed_data();
  float* xo = x_out->typed_data();
  float* mo = m_out->typed_data();
  const int64_t num_shifts = static_cast<int64_t>(shifts.size());
  std::vector<int64_t> shift(num_shifts);
  for (int64_t k = 0; k < num_shifts; ++k) shift[k] = ((shifts[k] % n) + n) % n;
  const int64_t num_blocks = (d + block - 1) / block;

#pragma omp parallel
  {
    std::vector<float> y(static_cast<size_t>(n * block));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t c0 = b * block;
      const int64_t cw = std::min(block, d - c0);
      // Every node's local step for this block of columns; x is read before any of it is written.
      for (int64_t i = 0; i < n; ++i) {
        const float* xi = xp + i * d + c0;
        const float* mi = mp + i * d + c0;
        const float* gi = gp + i * d + c0;
        float* moi = mo + i * d + c0;
        float* yi = y.data() + i * block;
#pragma omp simd
        for (int64_t j = 0; j < cw; ++j) {
          const float mm = beta * mi[j] + gi[j];
          moi[j] = mm;
          yi[j] = xi[j] - lr * mm;
        }
      }
      // Row i of W y: its own step and the rows at its shifts, written over x.
      for (int64_t i = 0; i < n; ++i) {
        float* out = xo + i * d + c0;
        const float* yi = y.data() + i * block;
#pragma omp simd
        for (int64_t j = 0; j < cw; ++j) out[j] = self_weight * yi[j];
        for (int64_t k = 0; k < num_shifts; ++k) {
          const float w = weights[k];
          const float* ys = y.data() + ((i + shift[k]) % n) * block;
#pragma omp simd
          for (int64_t j = 0; j < cw; ++j) out[j] += w * ys[j];
        }
      }
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GossipjaxCirculantDmsgd, CirculantDmsgd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // [learning_rate, beta]
                                  .Attr<ffi::Span<const int64_t>>("shifts")
                                  .Attr<ffi::Span<const float>>("weights")
                                  .Attr<float>("self_weight")
                                  .Attr<int64_t>("block")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // x, aliased to the input
                                  .Ret<ffi::Buffer<ffi::F32>>());  // m, aliased to the input
