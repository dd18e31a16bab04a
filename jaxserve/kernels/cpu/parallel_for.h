// ParallelFor over XLA:CPU's intra-op thread pool, shared by the native CPU kernels.
#ifndef JAXSERVE_CPU_PARALLEL_FOR_H_
#define JAXSERVE_CPU_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// A helper thread is woken only for every this much of a call's work: waking one and waiting
// for it costs microseconds, which at small models' and batches' sizes was most of a kernel
// call (stories260K's matmuls and attention: about 7-19 us a call, mostly this).
constexpr double kMinNanosPerThread = 20000;

// The threads ParallelFor(pool, count, nanos, ...) runs on, the caller's included.
inline int64_t Workers(xla::ffi::ThreadPool& pool, int64_t count, double nanos) {
  return 1 + std::max<int64_t>(0, std::min<int64_t>({pool.num_threads(), count - 1,
                                   static_cast<int64_t>(nanos / kMinNanosPerThread) - 1}));
}

// Runs work(item) for item in [0, count) on the caller and the pool's threads: each takes the
// next item from a shared counter, and the caller returns once every item is done. A task that
// starts after the caller took the last item finds none, so nothing waits on a busy pool.
// `nanos`: the whole call's work on one thread, roughly; it bounds the threads used.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, double nanos, F work) {
  const int64_t helpers = Workers(pool, count, nanos) - 1;
  if (helpers == 0) {
    for (int64_t i = 0; i < count; ++i) work(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    int64_t done = 0;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto run = [state, count, work] {
    int64_t finished = 0;
    for (int64_t i; (i = state->next.fetch_add(1)) < count; ++finished) work(i);
    if (finished == 0) return;
    std::lock_guard<std::mutex> lock(state->mu);
    state->done += finished;
    if (state->done == count) state->cv.notify_all();
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(run)(run));
  run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done == count; });
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_PARALLEL_FOR_H_
