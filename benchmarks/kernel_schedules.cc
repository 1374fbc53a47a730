// What bounds the native DmSGD step: the library's kernel (gossipjax/_native/circulant_dmsgd.cc, included
// whole, so the code timed here is the code gj.gossip_sgd_step runs) against the machine's copy and against
// two schedules cut down from the kernel's own plan for a non-ring graph. Built and run by
// benchmarks/kernel_schedules.py (`python -m benchmarks --only kernel_schedules`).
//
//   copy                   x *= 1 in place, one OpenMP loop: the reference bandwidth (two passes)
//   no_mixing              m = beta m + g; x -= lr m, one OpenMP loop: the same five passes, no mixing
//   read_one, read_three   a sum over x (over x, m and g): reads alone, no writes. On this machine the
//                          writes back of an in-place loop ride along with its reads (read_three takes as
//                          long as no_mixing, read_one as long as the copy), so a step's floor is its reads
//   <graph>                CirculantStep, the library's step (shifts -s, 0, +s: one register pass along each
//                          cycle of stride s, as on the ring; others: the plan)
//   <graph>_own_row_only   the plan's rows, blocks and output times, but each output reads only its own
//                          row's y back from scratch: the least a schedule that sends every row through
//                          scratch and writes it later can cost
//   <graph>_mixing_only    the plan's outputs from the scratch slots, with no local steps: the cache reads
//                          of the mixing and the output stream, without the memory reads (one pass)
//   <graph>_block_<b>      the library's step with blocks of b columns instead of the ones AutoBlock picks
//                          (for 64 nodes of the exponential graph: 4,096 columns, 1 MiB of scratch per thread)
//   <case>_one_thread      copy, no_mixing and each graph's step again on one thread: a loop that one core
//                          can drive near the memory's speed loses little, a step bound by the work on the
//                          core takes up to twice as long
//
// kernel_schedules.py runs it twice: on the full problem, and on rows short enough to stay in cache
// (`<case>_in_cache`: the work on the cores alone, with no memory stream to wait for).
//
// Usage: kernel_schedules N D REPS NAME SHIFTS WEIGHTS SELF [NAME SHIFTS WEIGHTS SELF ...]
//   (SHIFTS, WEIGHTS: comma-separated). Checks each graph's step against a double-precision reference on a
//   small problem first, then prints one JSON object.
#include "../gossipjax/_native/circulant_dmsgd.cc"

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>

namespace {

constexpr float kLr = 0.05f, kBeta = 0.9f;
volatile float copy_scale = 1.0f;  // read at run time, so the compiler cannot drop the copy's multiply
volatile float read_sink;          // written, so the compiler cannot drop the reads

struct Graph {
  std::string name;
  std::vector<int64_t> shifts;
  std::vector<float> weights;
  float self_weight;
};

template <typename T>
std::vector<T> Split(const char* s) {
  std::vector<T> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(static_cast<T>(std::stod(item)));
  return out;
}

// The largest |kernel - reference| over one step of n x d, with d not a multiple of any block.
double MaxError(const Graph& gr, int64_t n, int64_t d) {
  std::vector<float> x(n * d), m(n * d), g(n * d);
  for (int64_t i = 0; i < n * d; ++i) {
    x[i] = std::sin(0.37 * i);
    m[i] = std::cos(0.11 * i);
    g[i] = std::sin(0.05 * i + 1.0);
  }
  std::vector<double> y(n * d), want(n * d);
  for (int64_t i = 0; i < n * d; ++i) y[i] = x[i] - double(kLr) * (double(kBeta) * m[i] + g[i]);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < d; ++j) {
      double a = gr.self_weight * y[i * d + j];
      for (size_t k = 0; k < gr.shifts.size(); ++k) {
        const int64_t src = ((i + gr.shifts[k]) % n + n) % n;
        a += gr.weights[k] * y[src * d + j];
      }
      want[i * d + j] = a;
    }
  CirculantStep(x.data(), m.data(), g.data(), x.data(), m.data(), n, d, gr.shifts, gr.weights, gr.self_weight, 0,
                kLr, kBeta);
  double err = 0;
  for (int64_t i = 0; i < n * d; ++i) err = std::max(err, std::abs(x[i] - want[i]));
  return err;
}

// The plan path of CirculantStep with the mixing cut down: mode 0 keeps the local steps and writes each
// output from its own row only; mode 1 drops the local steps and keeps the full mixing.
void CutPlan(float* x, float* m, const float* g, int64_t n, int64_t d, const Graph& gr, int mode) {
  const int K = static_cast<int>(gr.shifts.size());
  const Plan plan = MakePlan(n, SignedShifts(n, gr.shifts));
  const int64_t block = std::min(AutoBlock(plan), d);  // as CirculantStep with block 0
  const int64_t num_blocks = (d + block - 1) / block;
#pragma omp parallel
  {
    std::vector<float> scratch(static_cast<size_t>(plan.num_slots * block), 1.0f);
    std::vector<const float*> src(K);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t c0 = b * block, cw = std::min(block, d - c0);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t off = plan.row[t] * d + c0;
        if (mode == 0) LocalRow(x + off, m + off, g + off, m + off, scratch.data() + plan.slot[t] * block, cw, kLr, kBeta);
        for (int64_t w = plan.wbegin[t]; w < plan.wbegin[t + 1]; ++w) {
          const int32_t* slots = plan.wslot.data() + w * (K + 1);
          for (int k = 0; k < K; ++k) src[k] = scratch.data() + slots[k + 1] * block;
          Mix(x + plan.wrow[w] * d + c0, scratch.data() + slots[0] * block, mode == 0 ? 1.0f : gr.self_weight,
              src.data(), gr.weights.data(), mode == 0 ? 0 : K, cw);
        }
      }
    }
  }
}

// A sum over a (or over a + b * c), kept: reads alone, with 64 independent sums per thread so that
// neither the adds' latency nor the compiler's strict float order hides the memory's speed.
void ReadSum(const float* a, const float* b, const float* c, int64_t len) {
  constexpr int64_t kLanes = 64;
  float total = 0.0f;
#pragma omp parallel reduction(+ : total)
  {
    float acc[kLanes] = {};
#pragma omp for schedule(static)
    for (int64_t i = 0; i < len / kLanes; ++i) {
      const int64_t o = i * kLanes;
      if (b == nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[o + j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[o + j] + b[o + j] * c[o + j];
      }
    }
    for (float v : acc) total += v;
  }
  for (int64_t i = len / kLanes * kLanes; i < len; ++i) total += b == nullptr ? a[i] : a[i] + b[i] * c[i];
  read_sink = total;
}

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8 || (argc - 4) % 4 != 0) {
    std::fprintf(stderr, "usage: %s N D REPS NAME SHIFTS WEIGHTS SELF [...]\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]), d = std::atoll(argv[2]);
  const int reps = std::atoi(argv[3]);
  std::vector<Graph> graphs;
  for (int a = 4; a < argc; a += 4)
    graphs.push_back({argv[a], Split<int64_t>(argv[a + 1]), Split<float>(argv[a + 2]), std::strtof(argv[a + 3], nullptr)});

  std::vector<std::pair<std::string, double>> errors;
  for (const Graph& gr : graphs) errors.push_back({gr.name, MaxError(gr, n, 4 * kMaxBlock + 37)});

  // Page-aligned like XLA's buffers (at least 64 bytes): a vector's 16-byte alignment would split every load.
  auto alloc = [&] { return static_cast<float*>(std::aligned_alloc(4096, (n * d * sizeof(float) + 4095) / 4096 * 4096)); };
  float* x = alloc();
  float* m = alloc();
  float* g = alloc();
#pragma omp parallel for schedule(static)  // first touch by the threads that use the pages
  for (int64_t i = 0; i < n * d; ++i) {
    x[i] = 1.0f;
    m[i] = 0.0f;
    g[i] = 1e-3f * static_cast<float>(i % 7);
  }
  struct Case {
    std::string name;
    int passes;
    std::function<void()> run;
  };
  std::vector<Case> cases;
  cases.push_back({"copy", 2, [&] {
                     const float c = copy_scale;
#pragma omp parallel for schedule(static)
                     for (int64_t i = 0; i < n * d; ++i) x[i] *= c;
                   }});
  cases.push_back({"read_one", 1, [&] { ReadSum(x, nullptr, nullptr, n * d); }});
  cases.push_back({"read_three", 3, [&] { ReadSum(x, m, g, n * d); }});  // what every DmSGD step must read
  cases.push_back({"no_mixing", 5, [&] {
#pragma omp parallel for schedule(static)
                     for (int64_t i = 0; i < n * d; ++i) {
                       const float mm = kBeta * m[i] + g[i];
                       m[i] = mm;
                       x[i] -= kLr * mm;
                     }
                   }});
  for (const Graph& gr : graphs) {
    cases.push_back({gr.name, 5, [&, gr] {
                       CirculantStep(x, m, g, x, m, n, d, gr.shifts, gr.weights, gr.self_weight, 0, kLr, kBeta);
                     }});
    if (RingLike(n, SignedShifts(n, gr.shifts))) continue;  // the plan is for the other graphs
    cases.push_back({gr.name + "_own_row_only", 5, [&, gr] { CutPlan(x, m, g, n, d, gr, 0); }});
    cases.push_back({gr.name + "_mixing_only", 1, [&, gr] { CutPlan(x, m, g, n, d, gr, 1); }});
    for (int64_t block : {1024, 2048, 8192})  // the step with other blocks than AutoBlock's
      cases.push_back({gr.name + "_block_" + std::to_string(block), 5, [&, gr, block] {
                         CirculantStep(x, m, g, x, m, n, d, gr.shifts, gr.weights, gr.self_weight, block, kLr, kBeta);
                       }});
  }

  const size_t two_threads = cases.size();
  for (size_t k = 0; k < two_threads; ++k) {
    if (cases[k].name.find("_only") != std::string::npos || cases[k].name.find("_block_") != std::string::npos) continue;
    cases.push_back({cases[k].name + "_one_thread", cases[k].passes, [run = cases[k].run] {
                       const int threads = omp_get_max_threads();
                       omp_set_num_threads(1);
                       run();
                       omp_set_num_threads(threads);
                     }});
  }

  // Interleaved rounds, the order rotated each round; medians.
  std::vector<std::vector<double>> times(cases.size());
  for (auto& c : cases) c.run();  // warm-up: pages touched, plans and scratch allocated once
  for (int r = 0; r < reps; ++r)
    for (size_t k = 0; k < cases.size(); ++k) {
      const size_t q = (k + r) % cases.size();
      const double t0 = Now();
      cases[q].run();
      times[q].push_back(Now() - t0);
    }
  std::printf("{\"n\": %ld, \"d\": %ld, \"reps\": %d, \"threads\": %d, \"max_abs_error\": {", static_cast<long>(n),
              static_cast<long>(d), reps, omp_get_max_threads());
  for (size_t k = 0; k < errors.size(); ++k)
    std::printf("%s\"%s\": %.3g", k ? ", " : "", errors[k].first.c_str(), errors[k].second);
  std::printf("}, \"cases\": {");
  for (size_t k = 0; k < cases.size(); ++k) {
    std::sort(times[k].begin(), times[k].end());
    const double med = times[k][times[k].size() / 2];
    std::printf("%s\"%s\": {\"ms\": %.4f, \"passes\": %d}", k ? ", " : "", cases[k].name.c_str(), med * 1e3,
                cases[k].passes);
  }
  std::printf("}}\n");
  std::free(x);
  std::free(m);
  std::free(g);
  return 0;
}
