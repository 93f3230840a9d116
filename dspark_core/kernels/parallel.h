// When our kernels split their work between threads. The kernels are built with OpenMP (at::parallel_for), and
// a parallel region costs a wake-up of the other threads (with OMP_WAIT_POLICY=PASSIVE, what the pods run with,
// tens of microseconds each; a forward pass of SmolLM2 runs ~200 regions). Splitting every call, a one-token
// step took 2.2x as long on two threads as on one (2-core AVX2 EPYC); splitting none, the second core idled.
// So a call splits only when its work, in multiply-adds, reaches `parallel_min_work()`: by default 2^23, which
// on that machine kept the one- to 16-token passes within noise of one thread (the one-token step ~1.08x faster:
// the LM head's 28M multiply-adds split) and made 32 / 64 / 128 / 341-token passes 1.3 / 1.3-1.7 / 1.6-1.9 /
// 1.5-1.7x faster (scripts/kernel_threads.py). DSPARK_PARALLEL_MIN_WORK overrides it at load, the op
// dspark_cpu::set_parallel_min_work at run time; below it the calling thread runs the call alone. Where the work
// is split never changes a result: threads take whole output columns (matmuls) or whole rows (attention).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

namespace dspark_kernels {

constexpr int64_t kDefaultMinWork = int64_t{1} << 23;  // ~8M multiply-adds: ~0.1 ms on one core

inline std::atomic<int64_t>& parallel_min_work() {
  static std::atomic<int64_t> value{[] {
    const char* env = std::getenv("DSPARK_PARALLEL_MIN_WORK");
    return env != nullptr && *env != '\0' ? static_cast<int64_t>(std::atoll(env)) : kDefaultMinWork;
  }()};
  return value;
}

// Whether a call of `work` multiply-adds may run on more than one thread.
inline bool splits(int64_t work) { return work >= parallel_min_work().load(std::memory_order_relaxed); }

// The grain for at::parallel_for over `tasks` tasks: `grain` where the call splits, else `tasks` (at::parallel_for
// then runs it on the calling thread).
inline int64_t grain_for(int64_t tasks, bool split, int64_t grain) { return split ? grain : std::max<int64_t>(tasks, 1); }

}  // namespace dspark_kernels
