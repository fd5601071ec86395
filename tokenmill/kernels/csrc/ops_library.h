// The op namespace a build registers into. One source tree makes two libraries: the native build (-march=native)
// registers `torch.ops.tokenmill`; the AVX2-only build (--cpu-isa avx2 on a CPU that has more) is compiled with
// -DTM_NS=tokenmill_avx2, so both load into one process and Python picks one set by name (tokenmill/kernels).
#pragma once

#include <torch/library.h>

#ifndef TM_NS
#define TM_NS tokenmill
#endif

// Two levels, so TM_NS is expanded before TORCH_LIBRARY_* pastes it into names.
#define TM_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TM_LIBRARY_FRAGMENT(m) TM_LIBRARY_FRAGMENT_(TM_NS, m)
#define TM_LIBRARY_IMPL_(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define TM_LIBRARY_IMPL(key, m) TM_LIBRARY_IMPL_(TM_NS, key, m)
