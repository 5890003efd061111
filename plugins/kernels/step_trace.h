// A timeline of a step's work in the kernels, for bench/step_trace.py: when each op runs, when each of its calls
// to the thread pool starts and ends, and how many weight bytes a projection's call streams. Compiled in only with
// -DENGINE_KERNELS_TRACE (bench/step_trace.py builds such a library beside the usual one); otherwise every hook
// below is an empty inline function.
//
// Why not ORT's profiler: at a SmolLM2 float32 decode step its own bookkeeping put ~3.7 us between two nodes, where
// this trace measures 0.3-0.6 us, and the step ran 8.6 ms under it against 7.5 (bench/NOTES.md entries 51-52).
// Events carry CLOCK_MONOTONIC nanoseconds (steady_clock), the clock of Python's time.monotonic_ns, so the script
// places them between its own session.run calls.
#pragma once

#include <cstdint>

#ifdef ENGINE_KERNELS_TRACE
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#endif

namespace engine_kernels {

// What an event marks; bench/step_trace.py reads the same numbers.
enum TraceKind : uint64_t { kOpEnter = 1, kOpExit = 2, kCallEnter = 3, kCallExit = 4, kCallBytes = 5 };

// The ops an event names (kOpEnter/kOpExit's value).
enum TraceOp : uint64_t {
  kTraceQuantMatMul = 1,
  kTraceQuantMatMulAddRMSNorm = 2,
  kTraceQuantMLP = 3,
  kTraceQuantMLPAddRMSNorm = 4,
  kTraceQuantGather = 5,
  kTraceAttention = 6,
  kTraceAddRMSNorm = 7,
  kTraceBf16MatMul = 8,
};

struct TraceEvent {
  uint64_t ns, kind, value;
};

#ifdef ENGINE_KERNELS_TRACE
// Events of every thread, in a buffer of kCapacity (later events are dropped).
class Trace {
 public:
  static constexpr size_t kCapacity = size_t{1} << 21;
  static Trace& get() {
    static Trace trace;
    return trace;
  }
  void add(uint64_t kind, uint64_t value) {
    const size_t at = size_.fetch_add(1, std::memory_order_relaxed);
    if (at >= kCapacity) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
    events_[at] = {static_cast<uint64_t>(ns), kind, value};
  }
  // Copies up to `capacity` events into `out` and empties the buffer; returns how many it copied.
  size_t take(TraceEvent* out, size_t capacity) {
    const size_t n = std::min({size_.exchange(0), kCapacity, capacity});
    std::copy_n(events_.get(), n, out);
    return n;
  }

 private:
  Trace() : events_(new TraceEvent[kCapacity]) {}
  std::unique_ptr<TraceEvent[]> events_;
  std::atomic<size_t> size_{0};
};

inline void trace(TraceKind kind, uint64_t value) { Trace::get().add(kind, value); }
#else
inline void trace(TraceKind, uint64_t) {}
#endif

// An op's compute from construction to destruction.
struct TracedOp {
  explicit TracedOp(TraceOp op) : op_(op) { trace(kOpEnter, op); }
  ~TracedOp() { trace(kOpExit, op_); }
  TracedOp(const TracedOp&) = delete;
  TracedOp& operator=(const TracedOp&) = delete;

 private:
  TraceOp op_;
};

}  // namespace engine_kernels
