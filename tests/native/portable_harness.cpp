// Runs one portable kernel (tokenmill/kernels/csrc/portable_kernels.h) on inputs a test wrote, without torch, so
// the ARM NEON build runs under qemu-aarch64 on an x86 machine (tests/test_portable_kernels.py builds it with
// aarch64-linux-gnu-g++ and compares what it writes with the torch ops' results).
//
//   portable_harness KERNEL DIR     reads DIR/args.txt (integers) and DIR/<name>.bin inputs, writes DIR/out.bin
//
// KERNEL: norm (rows t, width d; x, w, residual bf16; out: x normed, then the residual), silu (t, d; x [t, 2d]),
// rope (heads h, d, position p; x [h, d] bf16, cos/sin [*, d] fp32), argmax (t, v; x), gemm (m, k, n, gated;
// x, packed bf16; bias fp32), quant (m, k, n, bits, group; x bf16, q u8, scale/min fp16, bias fp32),
// dequant (k, n, bits, group; q, scale, min: the blocks' panels).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../../tokenmill/kernels/csrc/portable_kernels.h"

#if !defined(TM_SIMD8)
#error "portable_harness needs AVX2 + FMA + F16C or ARM NEON"
#endif

using namespace tm_portable;

namespace {

std::string dir;

template <typename T>
std::vector<T> read(const char* name) {
  std::ifstream f(dir + "/" + name, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

template <typename T>
void write(const std::vector<T>& v) {
  std::ofstream f(dir + "/out.bin", std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::vector<int64_t> args() {
  std::ifstream f(dir + "/args.txt");
  std::vector<int64_t> a;
  for (int64_t v; f >> v;) a.push_back(v);
  return a;
}

using Args = std::vector<int64_t>;

void run_norm(const Args& a) {
  const int64_t t = a[0], d = a[1];
  auto x = read<bf16>("x.bin"), w = read<bf16>("w.bin"), res = read<bf16>("residual.bin");
  std::vector<bf16> plain(t * d);
  for (int64_t i = 0; i < t; ++i) norm_row(plain.data() + i * d, x.data() + i * d, nullptr, w.data(), d, 1e-5f);
  for (int64_t i = 0; i < t; ++i) norm_row(x.data() + i * d, x.data() + i * d, res.data() + i * d, w.data(), d, 1e-5f);
  plain.insert(plain.end(), x.begin(), x.end());
  plain.insert(plain.end(), res.begin(), res.end());
  write(plain);
}

void run_silu(const Args& a) {
  const int64_t t = a[0], d = a[1];
  auto x = read<bf16>("x.bin");
  std::vector<bf16> out(t * d);
  for (int64_t i = 0; i < t; ++i) silu_mul_row(out.data() + i * d, x.data() + i * 2 * d, x.data() + i * 2 * d + d, d);
  write(out);
}

void run_rope(const Args& a) {
  const int64_t h = a[0], d = a[1], p = a[2];
  auto x = read<bf16>("x.bin");
  auto cos = read<float>("cos.bin"), sin = read<float>("sin.bin");
  std::vector<bf16> out(h * d);
  for (int64_t i = 0; i < h; ++i) rope_head(out.data() + i * d, x.data() + i * d, cos.data() + p * d, sin.data() + p * d, d);
  write(out);
}

void run_argmax(const Args& a) {
  const int64_t t = a[0], v = a[1];
  auto x = read<bf16>("x.bin");
  std::vector<int64_t> out(t);
  for (int64_t i = 0; i < t; ++i) out[i] = argmax_row(x.data() + i * v, v);
  write(out);
}

void run_gemm(const Args& a) {
  const int64_t m = a[0], k = a[1], n = a[2];
  const bool gated = a[3] != 0;
  auto x = read<bf16>("x.bin"), packed = read<bf16>("packed.bin");
  auto bias = read<float>("bias.bin");
  std::vector<bf16> y(m * (gated ? n / 2 : n));
  tile_gemm_range(x.data(), m, k, packed.data(), n, nullptr, bias.empty() ? nullptr : bias.data(), y.data(), gated,
                  0, gated ? n / kBlockN / 2 : n / kBlockN);
  write(y);
}

void run_quant(const Args& a) {
  const int64_t m = a[0], k = a[1], n = a[2], bits = a[3], group = a[4];
  auto x = read<bf16>("x.bin");
  auto q = read<uint8_t>("q.bin");
  auto scale = read<uint16_t>("scale.bin"), mn = read<uint16_t>("min.bin");
  auto bias = read<float>("bias.bin");
  const QuantView w{q.data(), scale.data(), bits == 4 ? mn.data() : nullptr, bits, group, k, n};
  QuantRows rows;
  size_rows(rows, m, k, group);
  for (int64_t i = 0; i < m; ++i) quantize_row(rows, x.data() + i * k, i, k, group);
  std::vector<bf16> y(m * n);
  const float* bp = bias.empty() ? nullptr : bias.data();
  if (bits == 8) quant_gemm_range<8>(m, w, rows, bp, y.data(), 0, n / kBlockN);
  else quant_gemm_range<4>(m, w, rows, bp, y.data(), 0, n / kBlockN);
  write(y);
}

void run_dequant(const Args& a) {
  const int64_t k = a[0], n = a[1], bits = a[2], group = a[3];
  auto q = read<uint8_t>("q.bin");
  auto scale = read<uint16_t>("scale.bin"), mn = read<uint16_t>("min.bin");
  const QuantView w{q.data(), scale.data(), bits == 4 ? mn.data() : nullptr, bits, group, k, n};
  std::vector<bf16> panels(n * k);
  for (int64_t b = 0; b < n / kBlockN; ++b) dequantize_panel(w, b, panels.data() + b * k * kBlockN);
  write(panels);
}

struct Kernel {
  const char* name;
  void (*run)(const Args&);
};

constexpr Kernel kKernels[] = {{"norm", run_norm},     {"silu", run_silu},   {"rope", run_rope},
                               {"argmax", run_argmax}, {"gemm", run_gemm},   {"quant", run_quant},
                               {"dequant", run_dequant}};

int run(const std::string& kernel) {
  for (const Kernel& k : kKernels) {
    if (kernel == k.name) {
      k.run(args());
      return 0;
    }
  }
  std::fprintf(stderr, "unknown kernel %s\n", kernel.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s KERNEL DIR\n", argv[0]);
    return 2;
  }
  dir = argv[2];
#if defined(TM_SIMD8_NEON)
  std::printf("neon%s\n",
#if defined(__ARM_FEATURE_DOTPROD)
              " +dotprod"
#else
              ""
#endif
  );
#else
  std::printf("avx2\n");
#endif
  return run(argv[1]);
}
