// Layouts of the int8 dequantize kernel timed side by side on one GPU (CUDA events, median of 11
// samples of 20 launches, 64 M codes, 256-code blocks), each output checked bit for bit against a
// host reference after the buffer is poisoned. Decides how xla_ext/cuda_kernels.cuh lays out
// jaxring_dequantize_int8; it is not part of the library. The "flat" rows run the library's own
// DequantizeFlatKernel at each layout.
//
//   nvcc -O3 -arch=sm_90 --fmad=false -std=c++17 -o /tmp/dv \
//       benchmarks/scripts/dequantize_variants.cu && /tmp/dv
//
// Variants: "warp" gives each warp one quantization block (4 codes per lane access, the layout
// shipped before); "flat V×U" lets each thread take U accesses of V codes, the U accesses a thread
// block apart (coalesced), all loads issued before the first store, the block's scale read per
// access (an L1 hit for all but the first). "copy" is cudaMemcpyAsync of the output's bytes, read
// and written, the card's device-to-device rate; "convert" is flat 4×4 without the scale, the
// ceiling of any layout that reads the codes and writes the output once.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../xla_ext/cuda_kernels.cuh"

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T e[V];
};

__device__ __forceinline__ void Put(float* p, float v) { *p = v; }
__device__ __forceinline__ void Put(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T, int V>
__device__ __forceinline__ void StoreCodes(T* out, const Pack<int8_t, V>& c, float s) {
  Pack<T, V> o;
#pragma unroll
  for (int k = 0; k < V; ++k) Put(&o.e[k], __fmul_rn(static_cast<float>(c.e[k]), s));
  *reinterpret_cast<Pack<T, V>*>(out) = o;
}

template <typename T, int V>
__global__ void Warp(const int8_t* q, const float* scales, int64_t n, int64_t bs, T* out) {
  const int64_t warps = int64_t{gridDim.x} * 8, nb = n / bs;
  const int lane = threadIdx.x & 31;
  for (int64_t g = blockIdx.x * int64_t{8} + (threadIdx.x >> 5); g < nb; g += warps) {
    const float s = scales[g];
    const int64_t off = g * bs;
#pragma unroll 2
    for (int64_t i = int64_t{lane} * V; i < bs; i += 32 * V)
      StoreCodes<T, V>(out + off + i, *reinterpret_cast<const Pack<int8_t, V>*>(q + off + i), s);
  }
}

// The ceiling: the flat layout with no scale at all (codes converted, nothing else).
template <typename T, int V, int U>
__global__ void Convert(const int8_t* q, int64_t nvec, T* out) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x * U;
  for (int64_t base = int64_t{blockIdx.x} * blockDim.x * U + threadIdx.x; base < nvec;
       base += step) {
    Pack<int8_t, V> c[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + int64_t{u} * blockDim.x < nvec)
        c[u] = reinterpret_cast<const Pack<int8_t, V>*>(q)[base + int64_t{u} * blockDim.x];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = base + int64_t{u} * blockDim.x;
      if (v < nvec) StoreCodes<T, V>(out + v * V, c[u], 1.0f);
    }
  }
}

struct Timer {
  cudaEvent_t a, b;
  Timer() { CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b)); }
  template <class F>
  float MedianUs(F&& f, int launches = 20, int samples = 11) {
    f();
    CHECK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int s = 0; s < samples; ++s) {
      CHECK(cudaEventRecord(a));
      for (int i = 0; i < launches; ++i) f();
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms * 1000.0f / launches);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

uint16_t Bf16Bits(float f) {  // round to nearest even, as __float2bfloat16_rn (no NaN here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
void Run(const char* tname, const int8_t* dq, const float* ds, const std::vector<int8_t>& hq,
         const std::vector<float>& hs, int64_t n, int64_t bs, int shift, double copy_gbs) {
  T* out;
  CHECK(cudaMalloc(&out, n * sizeof(T)));
  std::vector<T> host(n);
  const double bytes = static_cast<double>(n) * (1 + sizeof(T)) + (n / bs) * 4.0;
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto check = [&](const char* name, bool scaled) {
    CHECK(cudaMemcpy(host.data(), out, n * sizeof(T), cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float want = scaled ? static_cast<float>(hq[i]) * hs[i / bs] : hq[i];
      bool ok;
      if constexpr (sizeof(T) == 4) {
        ok = std::memcmp(&host[i], &want, 4) == 0;
      } else {
        uint16_t got;
        std::memcpy(&got, &host[i], 2);
        ok = got == Bf16Bits(want);
      }
      bad += !ok;
    }
    if (bad) std::printf("  %s %s: %lld WRONG elements\n", tname, name, (long long)bad);
    return bad == 0;
  };
  auto row = [&](const char* name, bool scaled, auto launch) {
    CHECK(cudaMemset(out, 0xff, n * sizeof(T)));
    launch();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    const bool ok = check(name, scaled);
    Timer tm;
    const float us = tm.MedianUs(launch);
    const double gbs = bytes / us / 1e3;
    std::printf("%-5s %-22s %9.1f us %8.0f GB/s %6.2f of copy %s\n", tname, name, us, gbs,
                gbs / copy_gbs, ok ? "exact" : "WRONG");
  };
  constexpr int V4 = sizeof(T) == 4 ? 4 : 8;
  row("warp", true, [&] {
    Warp<T, V4><<<std::min<int64_t>((n / bs + 7) / 8, 1 << 20), 256>>>(dq, ds, n, bs, out);
  });
  auto flat = [&](const char* name, auto v, auto u, auto scale, int64_t grid_cap) {
    constexpr int V = decltype(v)::value, U = decltype(u)::value;
    constexpr bool S = decltype(scale)::value;
    const int64_t nvec = n / V, grid = std::min<int64_t>((nvec + 256 * U - 1) / (256 * U), grid_cap);
    using C = std::conditional_t<sizeof(T) == 4, jaxring::DF32, jaxring::DBf16>;
    if constexpr (S)
      row(name, S, [&] {
        jaxring::DequantizeFlatKernel<C, V, U><<<grid, 256>>>(
            dq, ds, nvec, shift, reinterpret_cast<typename C::T*>(out));
      });
    else
      row(name, S, [&] { Convert<T, V, U><<<grid, 256>>>(dq, nvec, out); });
  };
  using std::integral_constant;
  const int64_t big = int64_t{1} << 30, persistent = int64_t{sms} * 8;
  flat("convert (no scale) 4x4", integral_constant<int, 4>{}, integral_constant<int, 4>{},
       std::false_type{}, big);
  flat("flat 4x1", integral_constant<int, 4>{}, integral_constant<int, 1>{}, std::true_type{}, big);
  flat("flat 4x2", integral_constant<int, 4>{}, integral_constant<int, 2>{}, std::true_type{}, big);
  flat("flat 4x4", integral_constant<int, 4>{}, integral_constant<int, 4>{}, std::true_type{}, big);
  flat("flat 4x8", integral_constant<int, 4>{}, integral_constant<int, 8>{}, std::true_type{}, big);
  flat("flat 4x4 persistent", integral_constant<int, 4>{}, integral_constant<int, 4>{},
       std::true_type{}, persistent);
  flat("flat 8x1", integral_constant<int, 8>{}, integral_constant<int, 1>{}, std::true_type{}, big);
  flat("flat 8x2", integral_constant<int, 8>{}, integral_constant<int, 2>{}, std::true_type{}, big);
  flat("flat 8x4", integral_constant<int, 8>{}, integral_constant<int, 4>{}, std::true_type{}, big);
  flat("flat 16x1", integral_constant<int, 16>{}, integral_constant<int, 1>{}, std::true_type{}, big);
  flat("flat 16x2", integral_constant<int, 16>{}, integral_constant<int, 2>{}, std::true_type{}, big);
  CHECK(cudaFree(out));
}

int main(int argc, char** argv) {
  const int64_t n = (argc > 1 ? std::atoll(argv[1]) : 64) << 20, bs = 256;
  const int shift = 8;
  std::vector<int8_t> hq(n);
  std::vector<float> hs(n / bs);
  uint64_t st = 0x9e3779b97f4a7c15ull;
  auto next = [&] { st ^= st << 13; st ^= st >> 7; st ^= st << 17; return st; };
  for (auto& v : hq) v = static_cast<int8_t>(static_cast<int>(next() % 255) - 127);
  for (auto& v : hs) v = 0.01f + (next() % 100000) / 100000.0f;
  int8_t* dq;
  float* ds;
  CHECK(cudaMalloc(&dq, n));
  CHECK(cudaMalloc(&ds, hs.size() * 4));
  CHECK(cudaMemcpy(dq, hq.data(), n, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(ds, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  // The card's device-to-device copy of the f32 output's bytes, counting read + written.
  char *ca, *cb;
  CHECK(cudaMalloc(&ca, n * 4));
  CHECK(cudaMalloc(&cb, n * 4));
  CHECK(cudaMemset(ca, 1, n * 4));
  Timer tm;
  const float copy_us = tm.MedianUs([&] { CHECK(cudaMemcpyAsync(cb, ca, n * 4, cudaMemcpyDeviceToDevice)); });
  const double copy_gbs = 2.0 * n * 4 / copy_us / 1e3;
  CHECK(cudaFree(ca));
  CHECK(cudaFree(cb));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %lld M codes, block %lld: device copy %.0f GB/s (read + written)\n", prop.name,
              (long long)(n >> 20), (long long)bs, copy_gbs);
  Run<float>("f32", dq, ds, hq, hs, n, bs, shift, copy_gbs);
  Run<__nv_bfloat16>("bf16", dq, ds, hq, hs, n, bs, shift, copy_gbs);
  return 0;
}
