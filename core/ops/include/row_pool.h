// Work split over the calling thread and one helper thread that the caller never waits for:
// a batch-1 decode step's one-row matmuls (cpu_gemm.h) and its attention (the CPU paged
// attention plugin), each a job of independent items written to their own places.
//
// On a few cores the API server, the benchmark client and the engine's own IO threads take
// bursts of CPU every token. Under OpenMP every matmul ends at a barrier, so whichever
// compute thread such a burst displaced held up the whole step (figures:
// docs/benchmarks-history.md, "bf16 CPU kernels by row count"). Here the helper is a
// SCHED_IDLE thread, so the kernel places those bursts on its core and the caller keeps
// its own; and the caller finishes a job alone when the helper is away:
//
// - The items (a matmul's 16-column blocks) are split into two contiguous halves, each
//   worked front to back (one stream of weights). The caller, done with its own, takes
//   what is left of the helper's from the back; only the helper's half is claimed by CAS.
// - The helper computes each item into its scratch and commits it before taking the next:
//   a per-item state word goes from whatever an earlier job left there to "writing" (by
//   compare-and-swap), the item is copied into the output, then "done". Once the shares
//   are empty, only the helper's last item can be unfinished: the caller waits briefly
//   for it, then takes it over by moving its state word to "taken" itself. A helper that
//   comes back late finds the item taken (or moved on by a later job) and drops it.
// - A job carries its arguments by value, and a late helper still reads the tensors they
//   point into: the job holds references to those, so they outlive the caller's use of
//   them until the helper is done.
//
// One pool per process (core's cpu_ops.cpp owns it; other libraries find it through the
// dispatcher, lookup_row_pool below). One caller at a time: a second concurrent caller
// finds the pool busy and runs its job alone.
#pragma once

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>

namespace plugserve {

// Computes item `item` of a job into `out` (its place in the job's output, or the
// helper's scratch), from the arguments the job was made with.
using ItemFn = void (*)(const void* args, int64_t item, void* out);

class RowPool {
 public:
  static constexpr int64_t kMaxItems = 1 << 13;  // items per job: 131072 outputs, any LM head
  static constexpr int64_t kArgBytes = 128;
  static constexpr int64_t kScratchBytes = 4096;  // the most an item may write

  struct Job {
    ItemFn fn;
    int64_t items;
    void* out;  // item i at out + i * item_bytes
    int64_t item_bytes, last_item_bytes;  // the last may be shorter (a partial block)
    // What the arguments point into, held by every copy of the job: a helper that comes
    // back late still reads them (and drops what it computes), so they must not be freed
    // under it when the caller's tensors go.
    std::array<at::Tensor, 4> inputs;
    alignas(16) unsigned char args[kArgBytes];
  };

  // A job of `items` items computed by fn from a copy of `args`.
  template <typename Args>
  static Job make_job(ItemFn fn, const Args& args, int64_t items, void* out, int64_t item_bytes,
                      int64_t last_item_bytes, std::array<at::Tensor, 4> inputs) {
    static_assert(std::is_trivially_copyable_v<Args> && sizeof(Args) <= kArgBytes,
                  "job arguments are copied as bytes into the job");
    Job job{fn, items, out, item_bytes, last_item_bytes, std::move(inputs), {}};
    std::memcpy(job.args, &args, sizeof(Args));
    return job;
  }

  RowPool() : helper_([this] { helper_loop(); }) { helper_.detach(); }

  // Off until a plugin turns it on, where OpenMP's threads stop spinning soon after a region
  // (the bf16 CPU kernels' cpu_features.openmp_spins_briefly): otherwise one spins for
  // milliseconds on the helper's core after every region and the idle-class helper gets no
  // time; the matmuls then keep OpenMP.
  void set_enabled(bool enabled) { enabled_.store(enabled, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // For tests: the helper's next item waits this long (or until release_helper) before it
  // is computed, as if the helper were displaced in the middle of it; how many items the
  // caller has taken over from the helper so far; and how many the helper computed, came
  // back with and dropped, finding them taken over.
  void stall_helper_once(int64_t microseconds) {
    released_.store(false, std::memory_order_relaxed);
    stall_us_.store(microseconds, std::memory_order_relaxed);
  }
  void release_helper() {
    stall_us_.store(0, std::memory_order_relaxed);
    released_.store(true, std::memory_order_relaxed);
  }
  int64_t items_taken_over() const { return taken_over_.load(std::memory_order_relaxed); }
  int64_t late_items_dropped() const { return dropped_.load(std::memory_order_relaxed); }
  // How many jobs were offered to the helper (not run alone by the caller) so far.
  int64_t jobs_shared() const { return shared_.load(std::memory_order_relaxed); }

  // Drops the tensors the job slots still hold, once the helper is idle (it copies no slot
  // until the next job): for a caller done with tensors that jobs ran over (the kernel
  // choice's measured copies of the weights), which the last kSlots jobs would otherwise
  // keep alive until later jobs replace them. Waits up to `wait` for the helper; false
  // where it was still busy then, or another caller held the pool.
  bool release_inputs(std::chrono::microseconds wait) {
    if (busy_.test_and_set(std::memory_order_acquire)) return false;
    const uint64_t g = generation_.load(std::memory_order_relaxed);
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (helper_idle_at_.load(std::memory_order_acquire) != g) {
      if (std::chrono::steady_clock::now() >= deadline) {
        busy_.clear(std::memory_order_release);
        return false;
      }
      std::this_thread::yield();
    }
    for (Job& job : jobs_) job.inputs = {};
    busy_.clear(std::memory_order_release);
    return true;
  }

  // Runs every item of `job`; returns once all of them are written to job.out.
  void run(const Job& job) {
    if (job.items < 2 || job.items > kMaxItems || job.item_bytes > kScratchBytes ||
        busy_.test_and_set(std::memory_order_acquire)) {
      for (int64_t b = 0; b < job.items; ++b) compute(job, b);
      return;
    }
    const uint64_t g = generation_.load(std::memory_order_relaxed) + 1;
    const uint64_t mid = static_cast<uint64_t>(job.items) / 2;
    if (copying_.load(std::memory_order_seq_cst) == static_cast<int64_t>(g % kSlots)) {
      // A helper kSlots jobs behind is copying this slot: leave it be.
      for (int64_t b = 0; b < job.items; ++b) compute(job, b);
      busy_.clear(std::memory_order_release);
      return;
    }
    jobs_[g % kSlots] = job;
    shared_.store(shared_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    theirs_.range.store(pack(g, mid, job.items), std::memory_order_relaxed);
    generation_.store(g, std::memory_order_seq_cst);
    wake_.store(static_cast<uint32_t>(g), std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) futex(FUTEX_WAKE_PRIVATE, 1);

    int64_t b;
    for (b = 0; b < static_cast<int64_t>(mid); ++b) compute(job, b);  // no one else takes these
    while ((b = claim(theirs_, g, false)) >= 0) compute(job, b);  // what the helper left
    // The helper took [mid, front) in order, committing each before taking the next: only
    // the last may still be in its hands.
    const int64_t front = front_of(theirs_.range.load(std::memory_order_acquire));
    if (front > static_cast<int64_t>(mid)) settle(job, front - 1, g);
    busy_.clear(std::memory_order_release);
  }

 private:
  static constexpr uint64_t kSlots = 4;
  static constexpr int kTagBits = 24, kIndexBits = 20;
  static constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
  // An item's state for job g: (g << 2) | one of these. Helper and caller both move it from
  // whatever an earlier job left there, so exactly one of them writes the item.
  static constexpr uint64_t kWriting = 1, kDone = 2, kTaken = 3;
  static constexpr auto kHelperWait = std::chrono::microseconds(20);
  static constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);

  struct alignas(64) Share {
    std::atomic<uint64_t> range{0};  // tag | front | end
  };

  static uint64_t tag_of(uint64_t g) { return g & ((uint64_t{1} << kTagBits) - 1); }
  static uint64_t pack(uint64_t g, uint64_t front, uint64_t end) {
    return (tag_of(g) << (2 * kIndexBits)) | (front << kIndexBits) | end;
  }
  static int64_t front_of(uint64_t r) {
    return static_cast<int64_t>((r >> kIndexBits) & kIndexMask);
  }

  static void compute(const Job& job, int64_t b) {
    job.fn(job.args, b, static_cast<char*>(job.out) + b * job.item_bytes);
  }

  // The next item of a share for job g, from its front or its back; -1 when none is left
  // or the share belongs to another job.
  static int64_t claim(Share& share, uint64_t g, bool from_front) {
    uint64_t r = share.range.load(std::memory_order_acquire);
    while (true) {
      const uint64_t front = (r >> kIndexBits) & kIndexMask, end = r & kIndexMask;
      if ((r >> (2 * kIndexBits)) != tag_of(g) || front >= end) return -1;
      const uint64_t next = from_front ? pack(g, front + 1, end) : pack(g, front, end - 1);
      if (share.range.compare_exchange_weak(r, next, std::memory_order_acq_rel))
        return static_cast<int64_t>(from_front ? front : end - 1);
    }
  }

  // The helper's last item of job g: done, being written (wait), or still in the hands of
  // a helper that was displaced: after a short wait the caller takes it over, and the
  // helper, when it comes back, finds the item taken and drops its result.
  void settle(const Job& job, int64_t b, uint64_t g) {
    std::atomic<uint64_t>& state = states_[b];
    const auto deadline = std::chrono::steady_clock::now() + kHelperWait;
    uint64_t s = state.load(std::memory_order_acquire);
    while ((s >> 2) != g && std::chrono::steady_clock::now() < deadline) {
      _mm_pause();
      s = state.load(std::memory_order_acquire);
    }
    if ((s >> 2) != g && state.compare_exchange_strong(s, (g << 2) | kTaken,
                                                       std::memory_order_acq_rel)) {
      taken_over_.fetch_add(1, std::memory_order_relaxed);
      compute(job, b);
      return;
    }
    while (state.load(std::memory_order_acquire) != ((g << 2) | kDone)) _mm_pause();
  }

  void helper_loop() {
    // Any other runnable thread preempts an idle-class one, and the kernel counts its core
    // as free when it places a waking thread: bursts land here, not on the caller's core.
    sched_param param{};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);
    uint64_t seen = generation_.load(std::memory_order_acquire);
    uint64_t idle_said = ~uint64_t{0};
    auto idle_since = std::chrono::steady_clock::now();
    while (true) {
      const uint64_t g = generation_.load(std::memory_order_acquire);
      if (g == seen) {
        // Every job up to `seen` is done with, and no copy of its slot is held here (said
        // once: a store every turn of the spin would keep the line moving).
        if (idle_said != seen) {
          helper_idle_at_.store(seen, std::memory_order_release);
          idle_said = seen;
        }
        if (std::chrono::steady_clock::now() - idle_since < kSpinBeforeSleep) {
          _mm_pause();
          continue;
        }
        sleeping_.store(true, std::memory_order_seq_cst);
        if (generation_.load(std::memory_order_seq_cst) == seen)
          futex(FUTEX_WAIT_PRIVATE, static_cast<uint32_t>(seen));
        sleeping_.store(false, std::memory_order_relaxed);
        idle_since = std::chrono::steady_clock::now();
        continue;
      }
      seen = g;
      // The caller writes slot g % kSlots again only for job g + kSlots, after publishing
      // g + 1: if g is still the newest job once `copying_` is set, the caller will not
      // write the slot while it is copied (it checks `copying_` first).
      copying_.store(static_cast<int64_t>(g % kSlots), std::memory_order_seq_cst);
      if (generation_.load(std::memory_order_seq_cst) != g) {
        copying_.store(-1, std::memory_order_relaxed);
        continue;  // a newer job is out; the next turn takes it
      }
      const Job job = jobs_[g % kSlots];  // holds the job's tensors until this turn ends
      copying_.store(-1, std::memory_order_release);
      {
        int64_t b;
        while ((b = claim(theirs_, g, true)) >= 0) {
          if (const int64_t stall = stall_us_.exchange(0, std::memory_order_relaxed)) {
            const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(stall);
            while (!released_.load(std::memory_order_relaxed) &&
                   std::chrono::steady_clock::now() < until)
              std::this_thread::sleep_for(std::chrono::microseconds(100));
          }
          job.fn(job.args, b, scratch_);
          // Write the item only if the caller has not taken it over (then, or in a later
          // job, which moved its state past g).
          std::atomic<uint64_t>& state = states_[b];
          uint64_t s = state.load(std::memory_order_acquire);
          if ((s >> 2) >= g ||
              !state.compare_exchange_strong(s, (g << 2) | kWriting, std::memory_order_acq_rel)) {
            dropped_.fetch_add(1, std::memory_order_relaxed);
            break;
          }
          std::memcpy(static_cast<char*>(job.out) + b * job.item_bytes, scratch_,
                      b == job.items - 1 ? job.last_item_bytes : job.item_bytes);
          state.store((g << 2) | kDone, std::memory_order_release);
        }
      }
      idle_since = std::chrono::steady_clock::now();
    }
  }

  void futex(int op, uint32_t value) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), op, value, nullptr, nullptr, 0);
  }

  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
  alignas(64) std::atomic<uint64_t> generation_{0};
  Share theirs_;  // the helper's share; the caller's own needs no claims
  alignas(64) std::atomic<uint32_t> wake_{0};
  std::atomic<bool> sleeping_{false};
  std::atomic<int64_t> stall_us_{0}, taken_over_{0}, dropped_{0};
  std::atomic<bool> released_{false};
  std::atomic<int64_t> shared_{0};  // written by the caller holding busy_ only
  std::atomic<int64_t> copying_{-1};  // the job slot the helper is copying, or -1
  alignas(64) std::atomic<uint64_t> helper_idle_at_{0};  // the newest job the helper is done with
  std::atomic<bool> enabled_{false};
  Job jobs_[kSlots]{};
  alignas(64) unsigned char scratch_[kScratchBytes];  // the helper's item before it commits it
  std::atomic<uint64_t> states_[kMaxItems]{};
  std::thread helper_;  // last: starts once every member above is initialized
};

// The process's pool as another library finds it (the one core's cpu_ops.cpp owns and
// exposes as plugserve_ops::row_pool_address), or nullptr while that library is not loaded:
// jobs then run on the calling thread alone. Looked up until found, then kept.
inline RowPool* lookup_row_pool() {
  static std::atomic<RowPool*> found{nullptr};
  if (RowPool* pool = found.load(std::memory_order_acquire)) return pool;
  auto handle = c10::Dispatcher::singleton().findSchema({"plugserve_ops::row_pool_address", ""});
  if (!handle.has_value()) return nullptr;
  auto* pool = reinterpret_cast<RowPool*>(handle->typed<int64_t()>().call());
  found.store(pool, std::memory_order_release);
  return pool;
}

}  // namespace plugserve
