// One DmSGD step for n nodes stacked on the leading axis, with a circulant mixing matrix,
// in place: m <- beta m + g;  y = x - lr m;  x_i <- w_self y_i + sum_k w_k y_{(i + s_k) mod n}.
//
// The step must read x, m, g once and write x, m once: five passes over n x d floats, and it
// runs at memory speed only if every one of those passes is a long sequential stream and what
// else the step does overlaps with them. So the columns are cut into blocks of `block` floats:
//
//   * Ring-like graphs (shifts -s, 0, +s for one s: the ring, and every round of the one-peer
//     exponential graph) are rings along the cycles i, i + s, i + 2s, ... of the rows. Each cycle
//     takes one pass over its rows in a block, four at a time: their local steps stay in registers
//     and the four output rows behind them are written in the same loop (RingBlock). Only two rows
//     of y go through scratch; a cycle of up to four rows keeps all of them in registers
//     (CycleBlock). This runs about as fast as the same update with no mixing at all.
//   * Other circulants stream the rows in an order that a plan fixes once per call (MakePlan):
//     step t computes the local step of one row into a scratch slot, then writes every output
//     row whose sources are all computed by now; rows start at n + s_min (the rows the first
//     outputs need across the wrap-around). A slot is handed back once its last reader is
//     written, and block is sized so that the live slots (up to n rows) stay in about 1 MiB of
//     cache. On an exponential graph nearly every row is live for the whole block, and reading
//     seven of them per output from cache keeps this path below the no-mixing speed: on one
//     thread it takes 1.8x its two-thread time, so it is bound by the work on the core, not by
//     memory (benchmarks/kernel_schedules, `<case>_one_thread`). With x, m and g in cache that work
//     alone takes about 60% of the step's time from memory (`<case>_in_cache`), and the plan hides
//     only about half of it under the memory streams.
//
// A time-varying circulant graph passes every round of its period; the step count, an input
// buffer, picks the round, so one compiled program serves every step.
//
// XLA:CPU runs this step far below memory bandwidth (the mixing reads each row at several
// offsets, recomputes the local step for each, and writes a fresh buffer that is then copied
// into the donated params); benchmarks/optimizer_bandwidth.py times both. Built at first use by
// gossipjax/_native.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kScratchBytes = int64_t{1} << 20;  // scratch slots per thread: one core's L2
constexpr int64_t kMaxBlock = 16384;                 // longer streams gain nothing measurable
constexpr int64_t kMinBlock = 256;

// The order of one column block, the same for every block.
struct Plan {
  int num_slots = 0;
  std::vector<int64_t> row;     // row computed at step t
  std::vector<int32_t> slot;    // its scratch slot
  std::vector<int64_t> wbegin;  // writes of step t: [wbegin[t], wbegin[t + 1])
  std::vector<int64_t> wrow;    // output row of each write
  std::vector<int32_t> wslot;   // per write: its own slot, then one slot per shift
};

Plan MakePlan(int64_t n, const std::vector<int64_t>& shift) {
  Plan p;
  const int K = static_cast<int>(shift.size());
  int64_t smin = 0;
  for (int64_t s : shift) smin = std::min(smin, s);
  auto src = [&](int64_t i, int k) { return ((i + shift[k]) % n + n) % n; };
  // Compute order, then the writes that become possible after each step (in row order).
  std::vector<char> done(n, 0);
  std::vector<int64_t> order;
  for (int64_t r = n + smin; r < n; ++r) order.push_back(r);
  for (int64_t r = 0; r < n + smin; ++r) order.push_back(r);
  std::vector<std::vector<int64_t>> writes(n);
  int64_t next = 0;
  for (int64_t t = 0; t < n; ++t) {
    done[order[t]] = 1;
    while (next < n) {
      bool ready = done[next];
      for (int k = 0; k < K && ready; ++k) ready = done[src(next, k)];
      if (!ready) break;
      writes[t].push_back(next++);
    }
  }
  // The step at which each row's y is read for the last time, then slots by first fit.
  std::vector<int64_t> last(n, 0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i : writes[t]) {
      last[i] = t;
      for (int k = 0; k < K; ++k) last[src(i, k)] = t;
    }
  std::vector<std::vector<int64_t>> freed(n);
  for (int64_t r = 0; r < n; ++r) freed[last[r]].push_back(r);
  std::vector<int32_t> slot_of(n, -1), free_slots;
  p.wbegin.push_back(0);
  for (int64_t t = 0; t < n; ++t) {
    int32_t s;
    if (free_slots.empty()) {
      s = p.num_slots++;
    } else {
      s = free_slots.back();
      free_slots.pop_back();
    }
    slot_of[order[t]] = s;
    p.row.push_back(order[t]);
    p.slot.push_back(s);
    for (int64_t i : writes[t]) {
      p.wrow.push_back(i);
      p.wslot.push_back(slot_of[i]);
      for (int k = 0; k < K; ++k) p.wslot.push_back(slot_of[src(i, k)]);
    }
    p.wbegin.push_back(static_cast<int64_t>(p.wrow.size()));
    for (int64_t r : freed[t]) free_slots.push_back(slot_of[r]);
  }
  return p;
}

// out = (acc ? out : w0 * y0) + sum_k w[k] * src[k], for K shifts at once.
template <int K>
void MixK(float* __restrict out, bool acc, const float* __restrict y0, float w0, const float* const* src_in,
          const float* w_in, int64_t len) {
  const float* src[K > 0 ? K : 1];
  float w[K > 0 ? K : 1];
  for (int k = 0; k < K; ++k) {
    src[k] = src_in[k];
    w[k] = w_in[k];
  }
  if (acc) {
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      float a = out[j];
      for (int k = 0; k < K; ++k) a += w[k] * src[k][j];
      out[j] = a;
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      float a = w0 * y0[j];
      for (int k = 0; k < K; ++k) a += w[k] * src[k][j];
      out[j] = a;
    }
  }
}

void Mix(float* out, const float* y0, float w0, const float* const* src, const float* w, int K, int64_t len) {
  bool acc = false;
  do {  // eight shifts per pass over the output row, which stays in cache meanwhile
    const int k = std::min(K, 8);
    switch (k) {
      case 0: MixK<0>(out, acc, y0, w0, src, w, len); break;
      case 1: MixK<1>(out, acc, y0, w0, src, w, len); break;
      case 2: MixK<2>(out, acc, y0, w0, src, w, len); break;
      case 3: MixK<3>(out, acc, y0, w0, src, w, len); break;
      case 4: MixK<4>(out, acc, y0, w0, src, w, len); break;
      case 5: MixK<5>(out, acc, y0, w0, src, w, len); break;
      case 6: MixK<6>(out, acc, y0, w0, src, w, len); break;
      case 7: MixK<7>(out, acc, y0, w0, src, w, len); break;
      default: MixK<8>(out, acc, y0, w0, src, w, len); break;
    }
    acc = true;
    src += k;
    w += k;
    K -= k;
  } while (K > 0);
}


// Pointers into column c0 of P rows: x, m, g and the momentum written at rows in[p], the output
// at rows out_row[p].
template <int P>
void RowPointers(const float* xp, const float* mp, const float* gp, float* xo, float* mo, int64_t d, int64_t c0,
                 const int64_t* in, const int64_t* out_row, const float** xr, const float** mr, const float** gr,
                 float** mw, float** out) {
  for (int p = 0; p < P; ++p) {
    const int64_t off = in[p] * d + c0;
    xr[p] = xp + off;
    mr[p] = mp + off;
    gr[p] = gp + off;
    mw[p] = mo + off;
    out[p] = xo + out_row[p] * d + c0;
  }
}

// Positions [i, i + P) of a ring of rows (row[k] receives from row[k - 1], itself and row[k + 1]):
// their local steps are kept in registers, and the P outputs at positions [i - 1, i + P - 1) are
// written in the same pass. Only the two rows before them come from scratch (ya, yb), and the last
// two go back to it (za, zb).
template <int P>
void RingRows(const float* xp, const float* mp, const float* gp, float* xo, float* mo, int64_t d,
              const int64_t* row, int64_t i, int64_t c0, int64_t cw, float lr, float beta, float wm, float w0,
              float wp, const float* ya, const float* yb, float* za, float* zb) {
  const float* xr[P];
  const float* mr[P];
  const float* gr[P];
  float* mw[P];
  float* out[P];
  RowPointers<P>(xp, mp, gp, xo, mo, d, c0, row + i, row + i - 1, xr, mr, gr, mw, out);
#pragma omp simd
  for (int64_t j = 0; j < cw; ++j) {
    float y[P + 2];
    y[0] = ya[j];
    y[1] = yb[j];
    for (int p = 0; p < P; ++p) {
      const float mm = beta * mr[p][j] + gr[p][j];
      mw[p][j] = mm;
      y[p + 2] = xr[p][j] - lr * mm;
    }
    for (int p = 0; p < P; ++p) out[p][j] = wm * y[p] + w0 * y[p + 1] + wp * y[p + 2];
    za[j] = y[P];
    zb[j] = y[P + 1];
  }
}

// The local step of one row into scratch, its momentum in place.
void LocalRow(const float* x, const float* m, const float* g, float* mo, float* y, int64_t cw, float lr, float beta) {
#pragma omp simd
  for (int64_t j = 0; j < cw; ++j) {
    const float mm = beta * m[j] + g[j];
    mo[j] = mm;
    y[j] = x[j] - lr * mm;
  }
}

// One column block of a ring of L >= 3 rows (row[0 .. L-1]), in one pass over them: the last row's
// y and the first's go to scratch first (outputs 0, L-2 and L-1 read them across the wrap-around),
// then positions 1 .. L-2 four at a time, then the outputs L-2 and L-1 from scratch.
void RingBlock(const float* xp, const float* mp, const float* gp, float* xo, float* mo, const int64_t* row,
               int64_t n, int64_t d, int64_t c0, int64_t cw, float lr, float beta, float wm, float w0, float wp,
               float* scratch, int64_t stride) {
  constexpr int kRows = 4;
  float* last = scratch;            // y of row[n-1]
  float* first = last + stride;     // y of row[0]
  float* ya = first + stride;       // the two most recent rows
  float* yb = ya + stride;
  const int64_t lo = row[n - 1] * d + c0, fo = row[0] * d + c0;
  LocalRow(xp + lo, mp + lo, gp + lo, mo + lo, last, cw, lr, beta);
  LocalRow(xp + fo, mp + fo, gp + fo, mo + fo, first, cw, lr, beta);
  const float* ra = last;
  const float* rb = first;
  for (int64_t i = 1; i < n - 1;) {
    const int64_t rows = std::min<int64_t>(kRows, n - 1 - i);
    switch (rows) {
      case 1: RingRows<1>(xp, mp, gp, xo, mo, d, row, i, c0, cw, lr, beta, wm, w0, wp, ra, rb, ya, yb); break;
      case 2: RingRows<2>(xp, mp, gp, xo, mo, d, row, i, c0, cw, lr, beta, wm, w0, wp, ra, rb, ya, yb); break;
      case 3: RingRows<3>(xp, mp, gp, xo, mo, d, row, i, c0, cw, lr, beta, wm, w0, wp, ra, rb, ya, yb); break;
      default: RingRows<kRows>(xp, mp, gp, xo, mo, d, row, i, c0, cw, lr, beta, wm, w0, wp, ra, rb, ya, yb); break;
    }
    ra = ya;
    rb = yb;
    i += rows;
  }
  // Now ra = y of row[n-3] and rb = y of row[n-2].
  float* o2 = xo + row[n - 2] * d + c0;
  float* o1 = xo + row[n - 1] * d + c0;
#pragma omp simd
  for (int64_t j = 0; j < cw; ++j) {
    o2[j] = wm * ra[j] + w0 * rb[j] + wp * last[j];
    o1[j] = wm * rb[j] + w0 * last[j] + wp * first[j];
  }
}

// One column block of a short ring of L rows (row[0 .. L-1]), all of them at once: every local step
// stays in registers and no row goes through scratch. For L = 2 both neighbours are the same row.
template <int L>
void CycleBlock(const float* xp, const float* mp, const float* gp, float* xo, float* mo, const int64_t* row,
                int64_t d, int64_t c0, int64_t cw, float lr, float beta, float wm, float w0, float wp) {
  const float* xr[L];
  const float* mr[L];
  const float* gr[L];
  float* mw[L];
  float* out[L];
  RowPointers<L>(xp, mp, gp, xo, mo, d, c0, row, row, xr, mr, gr, mw, out);
#pragma omp simd
  for (int64_t j = 0; j < cw; ++j) {
    float y[L];
    for (int p = 0; p < L; ++p) {
      const float mm = beta * mr[p][j] + gr[p][j];
      mw[p][j] = mm;
      y[p] = xr[p][j] - lr * mm;
    }
    for (int p = 0; p < L; ++p) out[p][j] = wm * y[(p + L - 1) % L] + w0 * y[p] + wp * y[(p + 1) % L];
  }
}

// Shifts mod n, signed, in (-n/2, n/2].
std::vector<int64_t> SignedShifts(int64_t n, const std::vector<int64_t>& shifts) {
  std::vector<int64_t> shift;
  for (int64_t s : shifts) {
    s = ((s % n) + n) % n;
    shift.push_back(s > n / 2 ? s - n : s);
  }
  return shift;
}

// The stride s when every nonzero shift is -s or +s (signed shifts), so that the rows form rings
// along the cycles i, i + s, i + 2s, ... and the one-pass ring kernel applies; 0 otherwise.
int64_t RingStride(int64_t n, const std::vector<int64_t>& shift) {
  int64_t s = 0;
  for (int64_t k : shift) {
    if (k == 0) continue;
    if (s != 0 && std::abs(k) != s) return 0;
    s = std::abs(k);
  }
  return n >= 2 ? std::max<int64_t>(s, 1) : 0;  // only self weights: any stride will do
}

bool RingLike(int64_t n, const std::vector<int64_t>& shift) { return RingStride(n, shift) != 0; }

int64_t Gcd(int64_t a, int64_t b) { return b == 0 ? a : Gcd(b, a % b); }

// The plan's block when none is given: its live slots fill about kScratchBytes.
int64_t AutoBlock(const Plan& plan) {
  const int64_t block = kScratchBytes / (static_cast<int64_t>(sizeof(float)) * plan.num_slots);
  return std::clamp<int64_t>(block / 16 * 16, kMinBlock, kMaxBlock);
}

// The whole step, for n rows of d floats, x and m in place (xo may alias xp, mo may alias mp).
// Shifts are taken mod n; block 0 picks the block from the graph. The FFI handler below calls it,
// and so does benchmarks/kernel_schedules.cc, which times it against other schedules.
void CirculantStep(const float* xp, const float* mp, const float* gp, float* xo, float* mo, int64_t n, int64_t d,
                   const std::vector<int64_t>& shifts, const std::vector<float>& weight, float self_weight,
                   int64_t block, float lr, float beta) {
  const int K = static_cast<int>(shifts.size());
  const std::vector<int64_t> shift = SignedShifts(n, shifts);
  if (const int64_t s = RingStride(n, shift)) {
    float wm = 0.0f, w0 = self_weight, wp = 0.0f;
    for (int k = 0; k < K; ++k) (shift[k] < 0 ? wm : shift[k] > 0 ? wp : w0) += weight[k];
    // The rows' cycles under i -> i + s: `cycles` of `len` rows each, in ring order.
    const int64_t cycles = Gcd(n, s), len = n / cycles;
    std::vector<int64_t> row(static_cast<size_t>(n));
    for (int64_t c = 0; c < cycles; ++c)
      for (int64_t k = 0; k < len; ++k) row[c * len + k] = (c + k * s) % n;
    if (block == 0) block = kMaxBlock;
    block = std::min(block, d);
    const int64_t num_blocks = (d + block - 1) / block;
#pragma omp parallel
    {
      std::vector<float> scratch(static_cast<size_t>(4 * block));
#pragma omp for schedule(static)
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t c0 = b * block, cw = std::min(block, d - c0);
        for (int64_t c = 0; c < cycles; ++c) {
          const int64_t* r = row.data() + c * len;
          switch (len) {  // s < n, so len >= 2; 8 rows at once ran slower than RingBlock (too many streams)
            case 2: CycleBlock<2>(xp, mp, gp, xo, mo, r, d, c0, cw, lr, beta, wm, w0, wp); break;
            case 3: CycleBlock<3>(xp, mp, gp, xo, mo, r, d, c0, cw, lr, beta, wm, w0, wp); break;
            case 4: CycleBlock<4>(xp, mp, gp, xo, mo, r, d, c0, cw, lr, beta, wm, w0, wp); break;
            default: RingBlock(xp, mp, gp, xo, mo, r, len, d, c0, cw, lr, beta, wm, w0, wp, scratch.data(), block);
          }
        }
      }
    }
    return;
  }

  const Plan plan = MakePlan(n, shift);
  if (block == 0) block = AutoBlock(plan);
  block = std::min(block, d);
  const int64_t num_blocks = (d + block - 1) / block;

#pragma omp parallel
  {
    std::vector<float> scratch(static_cast<size_t>(plan.num_slots * block));
    std::vector<const float*> src(K);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t c0 = b * block;
      const int64_t cw = std::min(block, d - c0);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t off = plan.row[t] * d + c0;
        LocalRow(xp + off, mp + off, gp + off, mo + off, scratch.data() + plan.slot[t] * block, cw, lr, beta);
        for (int64_t w = plan.wbegin[t]; w < plan.wbegin[t + 1]; ++w) {
          const int32_t* slots = plan.wslot.data() + w * (K + 1);
          for (int k = 0; k < K; ++k) src[k] = scratch.data() + slots[k + 1] * block;
          Mix(xo + plan.wrow[w] * d + c0, scratch.data() + slots[0] * block, self_weight, src.data(), weight.data(), K,
              cw);
        }
      }
    }
  }
}

}  // namespace

// Rounds r = 0 .. R-1 of a period: round r has num_shifts[r] shifts (consecutive in shifts and
// weights) and self_weights[r]; the step count picks round count mod R.
static ffi::Error CirculantDmsgd(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> g,
                                 ffi::Buffer<ffi::F32> hyper, ffi::Buffer<ffi::S32> count,
                                 ffi::Span<const int64_t> shifts, ffi::Span<const float> weights,
                                 ffi::Span<const int64_t> num_shifts, ffi::Span<const float> self_weights,
                                 int64_t block, ffi::ResultBuffer<ffi::F32> x_out, ffi::ResultBuffer<ffi::F32> m_out) {
  if (x.dimensions().size() < 1) return ffi::Error::InvalidArgument("params need a leading node axis");
  if (m.element_count() != x.element_count() || g.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("params, momentum and grads differ in size");
  if (hyper.element_count() != 2) return ffi::Error::InvalidArgument("hyper must be [learning_rate, beta]");
  if (count.element_count() != 1) return ffi::Error::InvalidArgument("count must be a scalar");
  if (shifts.size() != weights.size()) return ffi::Error::InvalidArgument("one weight per shift");
  const int64_t rounds = static_cast<int64_t>(self_weights.size());
  if (rounds < 1 || static_cast<int64_t>(num_shifts.size()) != rounds)
    return ffi::Error::InvalidArgument("one count of shifts and one self weight per round, at least one round");
  int64_t total = 0;
  for (int64_t k : num_shifts) total += k;
  if (total != static_cast<int64_t>(shifts.size())) return ffi::Error::InvalidArgument("shifts do not add up");
  if (block < 0) return ffi::Error::InvalidArgument("block must be positive (or 0: chosen from the graph)");
  const int64_t n = x.dimensions()[0];
  if (n == 0 || x.element_count() == 0) return ffi::Error::Success();
  const int64_t d = x.element_count() / n;
  const float lr = hyper.typed_data()[0], beta = hyper.typed_data()[1];
  const float* xp = x.typed_data();
  const float* mp = m.typed_data();
  const float* gp = g.typed_data();
  float* xo = x_out->typed_data();
  float* mo = m_out->typed_data();
  const int64_t r = ((static_cast<int64_t>(count.typed_data()[0]) % rounds) + rounds) % rounds;
  int64_t first = 0;
  for (int64_t k = 0; k < r; ++k) first += num_shifts[k];
  const int64_t last = first + num_shifts[r];
  CirculantStep(xp, mp, gp, xo, mo, n, d, std::vector<int64_t>(shifts.begin() + first, shifts.begin() + last),
                std::vector<float>(weights.begin() + first, weights.begin() + last), self_weights[r], block, lr, beta);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GossipjaxCirculantDmsgd, CirculantDmsgd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // [learning_rate, beta]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // the step count: picks the round
                                  .Attr<ffi::Span<const int64_t>>("shifts")  // every round's, in order
                                  .Attr<ffi::Span<const float>>("weights")
                                  .Attr<ffi::Span<const int64_t>>("num_shifts")  // per round
                                  .Attr<ffi::Span<const float>>("self_weights")  // per round
                                  .Attr<int64_t>("block")  // columns per block; 0: chosen from the graph
                                  .Ret<ffi::Buffer<ffi::F32>>()  // x, aliased to the input
                                  .Ret<ffi::Buffer<ffi::F32>>());  // m, aliased to the input
