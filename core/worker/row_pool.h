// The one-row matmul (a batch-1 decode step's weight stream) over the calling thread and
// one helper thread that the caller never waits for.
//
// On two cores the API server, the benchmark client and the engine's own IO threads need
// ~0.7 ms of CPU per token. Under OpenMP every matmul ends at a barrier, so whichever
// compute thread such a burst displaced held up the whole step: a 0.35 ms burst every 5 ms
// made a batch-1 step 0.6-1.2 ms slower. Here the helper is a SCHED_IDLE thread, so the
// kernel places those bursts on its core and the caller keeps its own; and the caller
// finishes a matmul alone when the helper is away:
//
// - The blocks (16 output columns each) are split into two contiguous halves, each worked
//   front to back (one stream of weights). The caller, done with its own, takes what is
//   left of the helper's from the back; only the helper's half is claimed by CAS.
// - The helper takes its blocks one at a time and commits each before taking the next:
//   a per-block state word goes from whatever an earlier job left there to "writing" (by
//   compare-and-swap), the block is copied into the output, then "done". Once the shares
//   are empty, only the helper's last block can be unfinished: the caller waits briefly
//   for it, then takes it over by moving its state word to "taken" itself. A helper that
//   comes back late finds the block taken (or moved on by a later job) and drops it.
// - A late helper still reads its job's row, weight and bias: the job holds references
//   to those tensors, so they outlive the caller's use of them until the helper is done.
//
// One pool per process (cpu_gemm.cpp owns it; other libraries find it through the
// dispatcher, see shared_row_pool in cpu_gemm.h). One caller at a time: a second
// concurrent caller finds the pool busy and runs its matmul alone.
#pragma once

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

namespace plugserve {

// What one item computes: out[col:col+16] = x . W_block(b) (+ bias), masked at n; out's
// elements are the job's out_bytes wide (bf16 or fp32).
using RowBlockFn = void (*)(const uint16_t* x, const uint16_t* w, int64_t pairs,
                            const float* bias, void* out, int64_t col, int64_t n);

class RowPool {
 public:
  static constexpr int64_t kMaxBlocks = 1 << 13;  // 131072 outputs: any LM head here

  struct Job {
    RowBlockFn block;
    const uint16_t* x;
    const uint16_t* w;
    int64_t block_stride, pairs;
    const float* bias;
    int64_t n, blocks;
    void* out;
    int64_t out_bytes;  // per element
    // The row, the weight and the bias, held by every copy of the job: a helper that comes
    // back late still reads them (and drops what it computes), so they must not be freed
    // under it when the caller's tensors go.
    std::array<at::Tensor, 3> inputs;
  };

  RowPool() : helper_([this] { helper_loop(); }) { helper_.detach(); }

  // Off until the process says OpenMP's threads stop spinning soon after a region (see
  // cpu_linear.py): otherwise one spins for milliseconds on the helper's core after every
  // region and the idle-class helper gets no time; the matmuls then keep OpenMP.
  void set_enabled(bool enabled) { enabled_.store(enabled, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // For tests: the helper's next block waits this long before it is computed, as if the
  // helper were displaced in the middle of it; and how many blocks the caller has taken
  // over from the helper so far.
  void stall_helper_once(int64_t microseconds) {
    stall_us_.store(microseconds, std::memory_order_relaxed);
  }
  int64_t blocks_taken_over() const { return taken_over_.load(std::memory_order_relaxed); }

  // Runs every block of `job`; returns once all of them are written to job.out.
  void run(const Job& job) {
    if (job.blocks < 2 || job.blocks > kMaxBlocks ||
        busy_.test_and_set(std::memory_order_acquire)) {
      for (int64_t b = 0; b < job.blocks; ++b) compute(job, b);
      return;
    }
    const uint64_t g = generation_.load(std::memory_order_relaxed) + 1;
    const uint64_t mid = static_cast<uint64_t>(job.blocks) / 2;
    if (copying_.load(std::memory_order_seq_cst) == static_cast<int64_t>(g % kSlots)) {
      // A helper kSlots jobs behind is copying this slot: leave it be.
      for (int64_t b = 0; b < job.blocks; ++b) compute(job, b);
      busy_.clear(std::memory_order_release);
      return;
    }
    jobs_[g % kSlots] = job;
    theirs_.range.store(pack(g, mid, job.blocks), std::memory_order_relaxed);
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
  // A block's state for job g: (g << 2) | one of these. Helper and caller both move it from
  // whatever an earlier job left there, so exactly one of them writes the block.
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
    job.block(job.x, job.w + b * job.block_stride, job.pairs, job.bias, job.out, b * 16, job.n);
  }

  // The next block of a share for job g, from its front or its back; -1 when none is left
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

  // The helper's last block of job g: done, being written (wait), or still in the hands of
  // a helper that was displaced: after a short wait the caller takes it over, and the
  // helper, when it comes back, finds the block taken and drops its result.
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
    auto idle_since = std::chrono::steady_clock::now();
    while (true) {
      const uint64_t g = generation_.load(std::memory_order_acquire);
      if (g == seen) {
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
          if (const int64_t stall = stall_us_.exchange(0, std::memory_order_relaxed))
            std::this_thread::sleep_for(std::chrono::microseconds(stall));
          const int64_t valid = std::min<int64_t>(16, job.n - b * 16);
          job.block(job.x, job.w + b * job.block_stride, job.pairs,
                    job.bias ? job.bias + b * 16 : nullptr, scratch_, 0, valid);
          // Write the block only if the caller has not taken it over (then, or in a later
          // job, which moved its state past g).
          std::atomic<uint64_t>& state = states_[b];
          uint64_t s = state.load(std::memory_order_acquire);
          if ((s >> 2) >= g ||
              !state.compare_exchange_strong(s, (g << 2) | kWriting, std::memory_order_acq_rel))
            break;
          std::memcpy(static_cast<char*>(job.out) + b * 16 * job.out_bytes, scratch_,
                      valid * job.out_bytes);
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
  std::atomic<int64_t> stall_us_{0}, taken_over_{0};
  std::atomic<int64_t> copying_{-1};  // the job slot the helper is copying, or -1
  std::atomic<bool> enabled_{false};
  Job jobs_[kSlots]{};
  alignas(64) float scratch_[16];  // the helper's block before it commits it (either width)
  std::atomic<uint64_t> states_[kMaxBlocks]{};
  std::thread helper_;  // last: starts once every member above is initialized
};

}  // namespace plugserve
