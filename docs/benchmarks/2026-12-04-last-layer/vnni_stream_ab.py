"""The VNNI kernel's tile loop (kernels/csrc/quant_gemm.cpp, copied as it is) built alone with g++, run over a
decode step's 120 linears at one row (30 layers of SmolLM2's shapes, distinct random weights, OpenMP over output
blocks as at::parallel_for splits them), with each software-prefetch variant alternated 40 times in one process.

    python vnni_stream_ab.py [bits=4|8] [head=1]

head=1: the tied lm head alone (49,152 x 576) instead of the 120 linears.
"""
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parents[3] / "tokenmill/kernels/csrc"
args = dict(a.split("=") for a in sys.argv[1:])
bits = int(args.get("bits", 4))
head = args.get("head") == "1"
VARIANTS = {   # what each 64-byte load of a streaming tile asks for
    "as is (since 9457554): the next block into L2":
        "prefetch_l2(at + J * w.block_bytes())",
    "before 9457554: T0 1 KB ahead, the next block into L2":
        "prefetch(at + 1024), prefetch_l2(at + J * w.block_bytes())",
    "L2 8 KB ahead only": "prefetch_l2(at + 8192)",
    "L2 4 KB ahead only": "prefetch_l2(at + 4096)",
    "L2 16 KB ahead only": "prefetch_l2(at + 16384)",
}

src = (CSRC / "quant_gemm.cpp").read_text()
layout = (CSRC / "quant_layout.h").read_text().replace("#include <ATen/ATen.h>\n", "").replace("#pragma once", "")
layout = layout[:layout.index("inline QuantView view_of")] + layout[layout.index("inline __m512 load_half16"):]
body = src[src.index("constexpr int64_t kPrefetchGroups"):src.index("at::Tensor quant_gemm(const at::Tensor& x")]
body = body[:body.index("// Filled in place")] + body[body.index("inline void store_bf16"):]
body = body.replace("#if defined(__AVX512VNNI__)\n", "")
line = "if (stream) prefetch_l2(at + J * w.block_bytes());"
assert body.count(line) == 2, "the tile's prefetch line changed: update this script"
body = body.replace(line, "if (stream) { " + " else ".join(
    f"if (PV == {i}) {{ {v}; }}" for i, v in enumerate(VARIANTS.values())) + " }")
body = body.replace("template <int M, int BITS>\nvoid tile(", "template <int M, int BITS, int PV>\nvoid tile(")
body = re.sub(r"tile<(\d), BITS>\(", r"tile<\1, BITS, PV>(", body)
body = body.replace("template <int BITS>\nvoid tile_rows(", "template <int BITS, int PV>\nvoid tile_rows(")
body = body.replace("template <int BITS>\nvoid gemm_range(", "template <int BITS, int PV>\nvoid gemm_range(")
body = body.replace("tile_rows<BITS>(", "tile_rows<BITS, PV>(")
cases = "\n".join(f"case {i}: gemm_range<{bits}, {i}>(1, w, ar, nullptr, y.data(), b0, b1); break;"
                  for i in range(len(VARIANTS)))
names = ", ".join(f'"{n}"' for n in VARIANTS)
main = f"""
#include <omp.h>
struct Lin {{ std::vector<uint8_t> q; std::vector<uint16_t> sc, mn; QuantView w; }};
int main() {{
  const int bits = {bits}, nv = {len(VARIANTS)};
  const char* names[] = {{{names}}};
  const int64_t shapes[4][2] = {{{{960, 576}}, {{576, 576}}, {{3072, 576}}, {{576, 1536}}}};
  const bool head = {int(head)};
  std::vector<Lin> lins(head ? 1 : 120);
  double total = 0;
  for (int i = 0; i < (int)lins.size(); ++i) {{
    const int64_t n = head ? 49152 : shapes[i % 4][0], k = head ? 576 : shapes[i % 4][1], G = bits == 4 ? 32 : k;
    Lin& l = lins[i];
    l.q.resize(n * k * bits / 8); for (auto& c : l.q) c = rand();
    l.sc.assign(n * k / G, 0x3c00); l.mn.assign(bits == 4 ? n * k / G : 0, 0x3c00);
    l.w = QuantView{{l.q.data(), l.sc.data(), bits == 4 ? l.mn.data() : nullptr, bits, G, k, n}};
    total += l.q.size() + 2.0 * (l.sc.size() + l.mn.size());
  }}
  QuantRows a[2];
  for (int j = 0; j < 2; ++j) {{
    const int64_t K = j ? 1536 : 576;
    a[j].hi.resize(K); a[j].lo.resize(K); a[j].scale.assign(K / 32, 0.01f); a[j].qsum.assign(K / 32, 1);
    a[j].gsum.assign(K / 32, 1.f);
    for (int i = 0; i < K; ++i) a[j].hi[i] = rand() % 100, a[j].lo[i] = rand() % 100;
  }}
  std::vector<uint16_t> y(49152);  // the widest output: the head
  std::vector<char> flush(256 << 20, 1);
  std::vector<std::vector<double>> times(nv);
  for (int r = 0; r < 40; ++r)
    for (int pv = 0; pv < nv; ++pv) {{
      for (size_t i = 0; i < flush.size(); i += 64) flush[i]++;
      auto t = std::chrono::steady_clock::now();
      for (int i = 0; i < (int)lins.size(); ++i) {{
        const QuantView& w = lins[i].w; const QuantRows& ar = a[w.k == 1536];
        const int64_t nb = w.n / 16;
#pragma omp parallel num_threads(2)
        {{
          const int64_t chunk = (nb + 1) / 2, b0 = omp_get_thread_num() * chunk, b1 = std::min(nb, b0 + chunk);
          switch (pv) {{ {cases} }}
        }}
      }}
      times[pv].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
    }}
  for (int pv = 0; pv < nv; ++pv) {{
    auto v = times[pv]; std::sort(v.begin(), v.end());
    printf("bits %d %s %-54s median %.3f ms  (%.1f GB/s)\\n", bits, head ? "head" : "step", names[pv], v[v.size() / 2] * 1e3,
           total / v[v.size() / 2] / 1e9);
  }}
}}
"""
prog = ("#include <immintrin.h>\n#include <cstdint>\n#include <cstdio>\n#include <cstdlib>\n#include <chrono>\n"
        "#include <vector>\n#include <algorithm>\n" + layout + "\nnamespace { using namespace tokenmill_quant;\n"
        + body + "\n}\n" + main)
with tempfile.TemporaryDirectory() as tmp:
    cpp, exe = Path(tmp) / "ab.cpp", Path(tmp) / "ab"
    cpp.write_text(prog)
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-o", str(exe), str(cpp)], check=True)
    subprocess.run([str(exe)], check=True)
