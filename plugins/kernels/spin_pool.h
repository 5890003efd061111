// SpinPool: the kernels' own intra-op threads, for sessions whose parallel work all runs in the engine's kernels.
//
// ORT's KernelContext_ParallelFor costs ~2 us a call on two threads (bench/NOTES.md entry 40), ~180 calls a SmolLM2
// decode step; this pool's calls cost ~0.8 us less (entry 41). Here a call is one store of a generation the
// spinning workers watch; the items are cut into one contiguous shard per thread, as ORT's loop counter cuts them,
// each thread claims its own shard's items one by one (an uncontended fetch_add on the shard's own cache line) and
// then steals from the other shards, so a step whose items differ in cost (causal attention tiles) stays balanced.
// A worker spins kSpinMicros after its last item (longer than the Python between two decode steps, ~0.2 ms), then
// sleeps on a futex until the next call, so an idle server holds no core. Items must not throw.
//
// A shard is one 64-bit word, its end (high 32 bits) and next item (low 32), so a claim reads both at once: a
// worker that claims late, after its call ended and the next one began, claims an item of the next call, whose fn
// and data were stored before its shards. Each thread adds the items it ran to done_ when it finds none left,
// and the caller waits for done_ == items, so no call ends while a claimed item runs.
#pragma once

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace engine_kernels {

class SpinPool {
 public:
  using Fn = void (*)(void*, size_t);
  static constexpr int64_t kSpinMicros = 2000;
  static constexpr const char* kThreadName = "engine-kernels";  // the workers' name in /proc (tests look for it)
  static constexpr size_t kMaxItems = (size_t{1} << 31);  // a shard's next may run past its end by the threads

  // The pool of `threads` threads (the caller and threads - 1 workers) this process shares between the kernels of
  // every session that asks for that many: two sets of spinning workers would take turns on the same cores, and
  // sessions mostly run one after another (another caller meanwhile runs its items itself). Never destroyed (the
  // library is linked -z nodelete).
  static SpinPool* shared(int threads) {
    static std::mutex mutex;
    static std::vector<std::pair<int, SpinPool*>> pools;
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [n, pool] : pools)
      if (n == threads) return pool;
    pools.emplace_back(threads, new SpinPool(threads));
    return pools.back().second;
  }

  explicit SpinPool(int threads) : shards_(new Shard[std::max(threads, 1)]), count_(std::max(threads, 1)) {
    for (int t = 1; t < count_; ++t) threads_.emplace_back([this, t] { work_loop(t); });
  }
  SpinPool(const SpinPool&) = delete;
  SpinPool& operator=(const SpinPool&) = delete;
  ~SpinPool() {
    stop_.store(true);
    wake_.fetch_add(1);
    futex_wake();
    for (auto& t : threads_) t.join();
  }

  // fn(data, i) for i < items on the caller and the workers; one call at a time (another caller, or an item
  // that calls again, runs its items itself).
  void run(size_t items, Fn fn, void* data) {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (items < 2 || count_ < 2 || items > kMaxItems || !lock.owns_lock()) {
      for (size_t i = 0; i < items; ++i) fn(data, i);
      return;
    }
    fn_ = fn;
    data_ = data;
    done_.store(0, std::memory_order_relaxed);
    for (int t = 0; t < count_; ++t) {
      const uint64_t begin = t * items / count_, end = (t + 1) * items / count_;
      shards_[t].word.store((end << 32) | begin, std::memory_order_release);
    }
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      wake_.fetch_add(1, std::memory_order_seq_cst);
      futex_wake();
    }
    claim_all(0);
    while (done_.load(std::memory_order_acquire) != items) pause();
  }

 private:
  struct alignas(64) Shard {
    std::atomic<uint64_t> word{0};
  };

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }

  void futex_wake() { syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
                              nullptr, 0); }

  // Thread `self`: its own shard's items, then the other shards', until every shard is empty.
  void claim_all(int self) {
    size_t ran = 0;
    for (int k = 0; k < count_; ++k) {
      std::atomic<uint64_t>& word = shards_[(self + k) % count_].word;
      for (;;) {
        const uint64_t w = word.fetch_add(1, std::memory_order_acq_rel);
        if ((w & 0xffffffff) >= (w >> 32)) break;
        fn_(data_, w & 0xffffffff);
        ++ran;
      }
    }
    if (ran) done_.fetch_add(ran, std::memory_order_acq_rel);
  }

  void work_loop(int self) {
    pthread_setname_np(pthread_self(), kThreadName);
    uint64_t seen = generation_.load();
    while (!stop_.load(std::memory_order_relaxed)) {
      auto start = std::chrono::steady_clock::now();
      for (int spins = 1; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        if (stop_.load(std::memory_order_relaxed)) return;
        pause();
        if (spins % 256 != 0) continue;
        if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(kSpinMicros)) continue;
        const uint32_t ticket = wake_.load(std::memory_order_seq_cst);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (generation_.load(std::memory_order_seq_cst) == seen && !stop_.load())
          syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), FUTEX_WAIT_PRIVATE, ticket, nullptr, nullptr, 0);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        start = std::chrono::steady_clock::now();
      }
      seen = generation_.load(std::memory_order_acquire);
      claim_all(self);
    }
  }

  std::mutex mutex_;
  Fn fn_ = nullptr;
  void* data_ = nullptr;
  std::unique_ptr<Shard[]> shards_;
  const int count_;  // threads, the caller's included
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<size_t> done_{0};
  alignas(64) std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace engine_kernels
