// Pins torch's OpenMP intra-op threads one per CPU: thread i runs only on cpus[i] (thread 0 is the caller).
// Unpinned threads migrate between cores and lose their caches; an environment variable such as OMP_PLACES
// cannot do this once torch has started its thread pool, so the pinning happens inside a parallel region.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include "ops_library.h"

#include <sched.h>

#include <cstdint>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>

namespace {

void bind_threads(const std::vector<int64_t>& cpus) {
  TORCH_CHECK(!cpus.empty(), "bind_threads: no CPUs given");
  const int n = static_cast<int>(cpus.size());
  at::set_num_threads(n);
  std::vector<int> failed(n, 0);
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    failed[t] = sched_setaffinity(0, sizeof(set), &set) != 0;
  }
  for (int t = 0; t < n; ++t) TORCH_CHECK(!failed[t], "bind_threads: cannot pin a thread to CPU ", cpus[t]);
}

}  // namespace

TM_LIBRARY_FRAGMENT(m) { m.def("bind_threads(int[] cpus) -> ()"); }
TM_LIBRARY_IMPL(CatchAll, m) { m.impl("bind_threads", &bind_threads); }

#endif
