//! Runs the project's CUDA kernels (`src/kernels/cuda/*.cu`) on the CPU with one
//! fiber per CUDA thread, so their indexing, masking and reductions can be
//! checked on a machine without a GPU: `__syncthreads` is a block barrier,
//! `__shfl_xor_sync` an exchange through memory between two warp barriers,
//! `__shared__` a static (blocks run one at a time). A barrier missing between a
//! write to shared memory and another thread's read, or a read and another thread's
//! overwrite, fails in one of the two thread orders run.sh runs, and is reported as a
//! race by its third run, built with ThreadSanitizer (EMULATE_RACES, below), in which
//! only a block barrier orders two threads' accesses; that run also reports shared
//! memory ordered only by a shuffle (a GPU's shuffles order no memory). barriers.sh
//! removes each of the kernels' barriers in turn: each removal fails both checks.
//! A fourth run, built with AddressSanitizer and UndefinedBehaviorSanitizer
//! (EMULATE_ASAN), reports any read or write past a kernel's inputs and outputs (each
//! its own exactly sized heap buffer) or past a `__shared__` array, and any signed
//! overflow in the index arithmetic: faults a GPU may let pass silently.
//! What no thread wrote (shared memory when a block starts, an output buffer) holds
//! NaNs in the first run and about 3.4e38 in the reverse one (unwritten_byte, below),
//! where a GPU leaves whatever was there: a kernel that reads shared memory its block
//! never wrote, or leaves an element of its output unwritten, fails its value checks.
//! It says nothing about speed or about the GPU's own arithmetic (expf, fmaf), which
//! the GPU tests (tests/gpu.rs) check on a device.
//! Built and run by scripts/cuda-emulate/run.sh, once per kernel file (-DATTENTION,
//! forward and backward; -DLOGPROB, -DTHETA, -DSOFTMAX, -DNORM, -DADAMW, -DROTARY).
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <sys/mman.h>
#include <ucontext.h>
#include <vector>

// Kernels in an unnamed namespace: each kernel file is included inside one, so that
// the `__shared__` statics of its template functions have internal linkage. GCC's
// AddressSanitizer leaves statics with vague (COMDAT) linkage uninstrumented, which
// would leave every shared array of a templated kernel out of the fourth run.
// Every `__shared__` array lies between __start_emu_shared and __stop_emu_shared
// (shared.ld), apart from the emulator's own state, so that each block can start with
// them unwritten (fill_shared, below) and the race check can forget them
// (race_fresh_shared). A section attribute puts them there, except that GCC 12 drops
// it from the statics of template instances; those, with -fdata-sections, each get a
// section named after the unnamed namespace, which shared.ld gathers too.

// The kernels' CUDA keywords and types for the host (flags.sh puts empty
// cuda_bf16.h and cuda_fp16.h on the include path).
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static __attribute__((section(".bss.emu_shared")))
extern char __start_emu_shared[], __stop_emu_shared[]; // from shared.ld
struct Dim { unsigned x = 0, y = 0, z = 0; };
Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
struct __nv_bfloat16 { uint16_t x; };
struct __half { _Float16 x; };
inline float __bfloat162float(__nv_bfloat16 b) {
    uint32_t u = uint32_t(b.x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return {uint16_t(0x7fc0)};
    u += 0x7fff + ((u >> 16) & 1); // round to nearest even
    return {uint16_t(u >> 16)};
}
inline float __half2float(__half h) { return float(h.x); }
inline __half __float2half(float f) { return {_Float16(f)}; }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline int min(int a, int b) { return a < b ? a : b; }
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
// IEEE round-to-nearest operations (no contraction into fused multiply-adds: this file
// is built without -mfma).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float2 make_float2(float x, float y) { return {x, y}; }

// Every CUDA thread of a block is a fiber (ucontext) on this one host thread, run
// until it reaches a barrier or returns: no OS threads to start, no locks. The fiber
// run next is always the first one free to run, in thread order or, with
// EMULATE_ORDER=reverse, from the last thread down. So a warp let go by a warp barrier
// (a shuffle) runs on before the threads behind it start, as far as the next block
// barrier: a barrier missing between a write to shared memory and another thread's
// read, or between a read and a later overwrite (the block reduction's "earlier call's
// readers"), gives stale data in one of the two orders (run.sh runs both).
// With EMULATE_RACES (run.sh's third run, built with -fsanitize=thread) each fiber
// is a ThreadSanitizer fiber and the switches between them order nothing: a block
// barrier is the only thing that orders two threads' memory accesses (each thread
// releases it on arrival and acquires it on leaving), so a shared or global word
// written by one thread and read or written by another with no barrier between them
// is reported as a race whatever order the fibers ran in. Warp barriers (a shuffle,
// mma.sync) order nothing, as on a GPU, where only `__syncwarp` would. The launch
// orders the host's writes before it and the kernel's after it. The emulator's own
// state (threadIdx, the barriers, the shuffle and mma exchange buffers, which stand
// for registers) is kept out of the check. Consecutive blocks run on different sets of
// fibers (RACE_SETS of them, each with its own stacks), so they are unordered, as on a
// GPU: two blocks writing one element race too. Blocks RACE_SETS apart share fibers,
// so thread t of the later one knows what the earlier block wrote before its last
// barrier (a fiber can't forget; a new one for every block took 0.2 ms each).
#ifdef EMULATE_RACES
#include <sanitizer/tsan_interface.h>
extern "C" void AnnotateIgnoreReadsBegin(const char *, int);
extern "C" void AnnotateIgnoreReadsEnd(const char *, int);
extern "C" void AnnotateIgnoreWritesBegin(const char *, int);
extern "C" void AnnotateIgnoreWritesEnd(const char *, int);
struct Untracked {
    Untracked() {
        AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
        AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
    }
    ~Untracked() {
        AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
        AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
    }
};
// Not instrumented, so that entering and leaving a function that switches fibers
// touches no fiber's shadow call stack.
#define UNINSTRUMENTED __attribute__((no_sanitize_thread))
UNINSTRUMENTED inline void hb_release(void *a) { __tsan_release(a); }
UNINSTRUMENTED inline void hb_acquire(void *a) { __tsan_acquire(a); }
constexpr unsigned RACE_SETS = 4;
UNINSTRUMENTED inline void *race_fiber_new() { return __tsan_create_fiber(0); }
UNINSTRUMENTED inline void *race_fiber_here() { return __tsan_get_current_fiber(); }
UNINSTRUMENTED inline void race_switch(void *to) { __tsan_switch_to_fiber(to, __tsan_switch_to_fiber_no_sync); }
// A block's shared memory is its own, but here it is a static, which a block leaves as
// the last one touched it. ThreadSanitizer forgets a range's accesses only where memory
// is allocated, and its Java heap's allocation call does that for any range: each block
// starts by "allocating" the section of the `__shared__` arrays.
extern "C" void __tsan_java_init(unsigned long heap_begin, unsigned long heap_size);
extern "C" void __tsan_java_alloc(unsigned long ptr, unsigned long size);
extern "C" void __tsan_java_free(unsigned long ptr, unsigned long size);
UNINSTRUMENTED inline void race_fresh_shared() {
    const unsigned long begin = (unsigned long)__start_emu_shared & ~7ul,
                        size = ((unsigned long)__stop_emu_shared - begin + 7) & ~7ul;
    static const bool heap = (__tsan_java_init(begin, size), true);
    (void)heap;
    __tsan_java_free(begin, size);
    __tsan_java_alloc(begin, size);
}
#else
#define UNINSTRUMENTED
struct Untracked {
    Untracked() {} // a user-provided constructor: no unused-variable warning
};
inline void hb_release(void *) {}
inline void hb_acquire(void *) {}
constexpr unsigned RACE_SETS = 1;
inline void *race_fiber_new() { return nullptr; }
inline void *race_fiber_here() { return nullptr; }
inline void race_switch(void *) {}
inline void race_fresh_shared() {}
#endif

struct Barrier {
    unsigned n, waiting = 0, generation = 0;
    const bool orders_memory; // a block barrier; a warp barrier orders nothing
    // What the threads arriving in a generation release and those leaving it acquire.
    // Two suffice: a thread cannot arrive at generation g + 2 before every thread has
    // left g.
    char hb[2] = {};
    Barrier(unsigned n, bool orders_memory) : n(n), orders_memory(orders_memory) {}
    void arrive_and_wait();
    // A thread that returned early leaves the barrier to the others.
    void arrive_and_drop() {
        if (orders_memory) hb_release(&hb[generation % 2]);
        if (--n > 0 && waiting == n) release();
    }
    void release();
};
struct Fiber {
    ucontext_t context;
    char *stack = nullptr;
    void *race = nullptr; // its ThreadSanitizer fiber (EMULATE_RACES)
    bool done = false;
    const Barrier *waits = nullptr; // the barrier this fiber waits at, and its generation then
    unsigned generation = 0;
};
constexpr size_t FIBER_STACK = 1 << 20;
std::vector<Fiber> fiber_sets[RACE_SETS];
Fiber *fibers; // the running block's
unsigned current;
ucontext_t scheduler;
void *scheduler_race; // the host thread's ThreadSanitizer fiber
const std::function<void()> *fiber_kernel;
std::unique_ptr<Barrier> block_bar;
std::vector<std::unique_ptr<Barrier>> warp_bar;
bool released; // a barrier let its fibers go since the scheduler last looked
// The host's writes before a launch; the kernel's, for after it.
char launch_hb, done_hb;
void Barrier::release() {
    waiting = 0;
    ++generation;
    released = true;
}
void Barrier::arrive_and_wait() {
    Untracked untracked;
    const unsigned g = generation;
    if (orders_memory) hb_release(&hb[g % 2]);
    if (++waiting == n) release();
    else {
        Fiber &f = fibers[current];
        f.waits = this;
        f.generation = g;
        race_switch(scheduler_race);
        swapcontext(&f.context, &scheduler);
    }
    if (orders_memory) hb_acquire(&hb[g % 2]);
}
// Not instrumented: it leaves its fiber for the scheduler's before it returns, where
// ThreadSanitizer would pop the function's entry from the scheduler's stack.
UNINSTRUMENTED void fiber_main() {
    hb_acquire(&launch_hb);
    const std::function<void()> *kernel;
    {
        Untracked untracked;
        kernel = fiber_kernel;
    }
    (*kernel)();
    hb_release(&done_hb);
    {
        Untracked untracked;
        block_bar->arrive_and_drop();
        warp_bar[current / 32]->arrive_and_drop();
        fibers[current].done = true;
    }
    race_switch(scheduler_race);
}
static float xf[1024];
static int xi[1024];
inline void __syncthreads() { block_bar->arrive_and_wait(); }
template <typename T> T shfl(T *buf, T v, int o) {
    Untracked untracked;
    const int t = threadIdx.x;
    buf[t] = v;
    warp_bar[t / 32]->arrive_and_wait();
    const T r = buf[t ^ o];
    warp_bar[t / 32]->arrive_and_wait();
    return r;
}
inline float __shfl_xor_sync(unsigned, float v, int o) { return shfl(xf, v, o); }
inline int __shfl_xor_sync(unsigned, int v, int o) { return shfl(xi, v, o); }
static double xd[1024];
inline double __shfl_xor_sync(unsigned, double v, int o) { return shfl(xd, v, o); }

// What a kernel finds where nothing was written: on a GPU, shared memory holds what the
// last block there left, and an output from candle's `alloc` whatever the memory held.
// Here both hold one byte repeated, EMULATE_UNWRITTEN (hex; default ff, which makes
// every f32, bf16 and f16 a NaN and every int -1; run.sh's reverse-order run takes 7f,
// about 3.4e38 as f32 or bf16, which a max or a comparison does not pass over as it
// does a NaN). So a kernel that reads shared memory no thread of its block wrote, or
// leaves an element of its output unwritten, fails its case's value check.
unsigned char unwritten_byte() {
    static const unsigned char b = [] {
        const char *e = std::getenv("EMULATE_UNWRITTEN");
        return e ? (unsigned char)std::strtoul(e, nullptr, 16) : 0xff;
    }();
    return b;
}
// An output buffer as candle's `alloc` gives it.
template <typename T> std::vector<T> unwritten(size_t n) {
    std::vector<T> v(n);
    std::memset((void *)v.data(), unwritten_byte(), n * sizeof(T));
    return v;
}
// Byte by byte through a volatile pointer: AddressSanitizer would check a memset, and
// report the red zones it keeps between the arrays.
__attribute__((no_sanitize_address)) void fill_shared() {
    const char b = char(unwritten_byte());
    for (volatile char *p = __start_emu_shared; p < __stop_emu_shared; ++p) *p = b;
}

/// Runs `kernel` over the grid, one block at a time, a fiber per CUDA thread.
void launch(Dim grid, unsigned threads, const std::function<void()> &kernel) {
    static const bool reverse = [] {
        const char *o = std::getenv("EMULATE_ORDER");
        return o && std::string(o) == "reverse";
    }();
    Untracked untracked;
    hb_release(&launch_hb);
    if (!scheduler_race) scheduler_race = race_fiber_here();
    blockDim = {threads, 1, 1};
    gridDim = grid;
    fiber_kernel = &kernel;
    for (auto &set : fiber_sets) {
        if (set.size() < threads) set.resize(threads);
        for (unsigned t = 0; t < threads; ++t)
            if (!set[t].stack) {
                // A guard page below each stack: an overflow faults instead of writing on.
                void *m = mmap(nullptr, FIBER_STACK + 4096, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
                if (m == MAP_FAILED || mprotect(m, 4096, PROT_NONE) != 0) {
                    std::perror("fiber stack");
                    std::exit(2);
                }
                set[t].stack = static_cast<char *>(m) + 4096;
                set[t].race = race_fiber_new();
            }
    }
    unsigned block = 0;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                fibers = fiber_sets[block++ % RACE_SETS].data();
                fill_shared();
                race_fresh_shared();
                block_bar = std::make_unique<Barrier>(threads, true);
                warp_bar.clear();
                for (unsigned w = 0; w < (threads + 31) / 32; ++w)
                    warp_bar.push_back(std::make_unique<Barrier>(std::min(32u, threads - 32 * w), false));
                for (unsigned t = 0; t < threads; ++t) {
                    Fiber &f = fibers[t];
                    getcontext(&f.context);
                    f.context.uc_stack = {f.stack, 0, FIBER_STACK};
                    f.context.uc_link = &scheduler;
                    makecontext(&f.context, fiber_main, 0);
#ifdef EMULATE_ASAN
                    // AddressSanitizer clears the shadow of a context's whole stack (its
                    // uc_stack) at every switch into it: 128 KB by mmap, most of the run's
                    // time. Without a size it leaves it; every frame on these stacks has
                    // returned before a stack is given to the next block's fiber.
                    f.context.uc_stack.ss_size = 0;
#endif
                    f.done = false;
                    f.waits = nullptr;
                }
                for (unsigned left = threads; left > 0;) {
                    bool ran = false;
                    released = false;
                    for (unsigned i = 0; i < threads && !released; ++i) {
                        const unsigned t = reverse ? threads - 1 - i : i;
                        Fiber &f = fibers[t];
                        if (f.done || (f.waits && f.waits->generation == f.generation)) continue;
                        f.waits = nullptr;
                        current = t;
                        threadIdx = {t, 0, 0};
                        race_switch(f.race);
                        swapcontext(&scheduler, &f.context);
                        ran = true;
                        left -= f.done;
                    }
                    if (!ran) {
                        std::printf("FAIL block (%u, %u, %u): %u threads wait at barriers the others "
                                    "never reach\n", x, y, z, left);
                        std::exit(1);
                    }
                }
            }
    hb_acquire(&done_hb);
}

int failures = 0;
void check(bool ok, const std::string &what) {
    if (!ok) {
        ++failures;
        std::printf("FAIL %s\n", what.c_str());
    }
}

// The larger of the worst error so far and a new one, a NaN (an unwritten or broken
// result) counting as infinite, where std::max would pass over it.
double worse(double worst, double e) { return std::isnan(e) ? INFINITY : std::max(worst, e); }

std::mt19937 rng(7);
std::vector<float> randn(size_t n, float sd) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (auto &x : v) x = d(rng);
    return v;
}
float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// a as the kernels' input type: f32 as it is, else rounded to bf16 or f16.
template <typename T> std::vector<T> narrowed(const std::vector<float> &a) {
    std::vector<T> r(a.size());
    for (size_t i = 0; i < a.size(); ++i) {
        if constexpr (std::is_same_v<T, float>) r[i] = a[i];
        else if constexpr (std::is_same_v<T, __half>) r[i] = __float2half(a[i]);
        else r[i] = __float2bfloat16(a[i]);
    }
    return r;
}

// Half-precision values widened (exactly) to f32.
template <typename T> std::vector<float> widened(const std::vector<T> &a) {
    std::vector<float> r(a.size());
    for (size_t i = 0; i < a.size(); ++i) {
        if constexpr (std::is_same_v<T, __half>) r[i] = __half2float(a[i]);
        else r[i] = __bfloat162float(a[i]);
    }
    return r;
}

// How many of got's half-precision values differ, bit for bit, from want rounded once.
template <typename T> size_t differ_from_rounded(const std::vector<T> &got, const std::vector<float> &want) {
    const std::vector<T> w = narrowed<T>(want);
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += std::memcmp(&got[i], &w[i], sizeof(T)) != 0;
    return differ;
}

// mma.sync m16n8k16 (row.col, f32 accumulators) for the host, as the kernels call it
// (`mma16816`): every lane's fragment registers are exchanged through memory between
// warp barriers, each lane rebuilds the whole 16×16 and 16×8 operands by the PTX ISA's
// layout of those registers and computes its own four accumulator elements. Lane
// (g, c) = (lane / 4, lane % 4): A's register r holds row g + 8·(r % 2) at columns
// 2c + 8·(r / 2) and +1; B's register r rows 2c + 8·r and +1 of column g; D's element
// e is row g + 8·(e / 2), column 2c + e % 2; the lower index in the low 16 bits.
#define TOKENFORMER_EMULATE
struct uint4 { unsigned x, y, z, w; };
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
inline unsigned short __half_as_ushort(__half h) {
    unsigned short u;
    std::memcpy(&u, &h.x, 2);
    return u;
}
inline float widen_bits(uint32_t h, __nv_bfloat16) { return __bfloat162float({uint16_t(h)}); }
inline float widen_bits(uint32_t h, __half) {
    const uint16_t u = uint16_t(h);
    __half x;
    std::memcpy(&x.x, &u, 2);
    return __half2float(x);
}
static uint32_t mma_a[1024][4], mma_b[1024][2];
template <typename T> void mma_emulated(float *d, const uint32_t *a, const uint32_t *b) {
    Untracked untracked;
    const int t = threadIdx.x, w = t / 32 * 32;
    std::memcpy(mma_a[t], a, sizeof mma_a[t]);
    std::memcpy(mma_b[t], b, sizeof mma_b[t]);
    warp_bar[t / 32]->arrive_and_wait();
    float A[16][16], B[16][8];
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, c = lane % 4 * 2;
        for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h) {
                A[g + 8 * (r % 2)][c + 8 * (r / 2) + h] = widen_bits(mma_a[w + lane][r] >> (16 * h), T());
                if (r < 2) B[c + 8 * r + h][g] = widen_bits(mma_b[w + lane][r] >> (16 * h), T());
            }
    }
    const int g = t % 32 / 4, c = t % 4 * 2;
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e / 2), col = c + e % 2;
        float acc = d[e];
        for (int kk = 0; kk < 16; ++kk) acc += A[row][kk] * B[kk][col];
        d[e] = acc;
    }
    warp_bar[t / 32]->arrive_and_wait();
}
inline void mma16816(float *d, const uint32_t *a, const uint32_t *b, __nv_bfloat16) {
    mma_emulated<__nv_bfloat16>(d, a, b);
}
inline void mma16816(float *d, const uint32_t *a, const uint32_t *b, __half) { mma_emulated<__half>(d, a, b); }
#define __align__(n) __attribute__((aligned(n)))

#ifdef ATTENTION
namespace { // internal linkage: see "Kernels in an unnamed namespace" above
#include "../../src/kernels/cuda/attention.cu"
} // namespace

// The SIMT forward with its split over keys off (null partials), in the tensor-core
// kernel's signature, so the cases below take either.
template <typename F> auto one_pass(F kernel) {
    return [kernel](const auto *q, const auto *k, const auto *v, auto *out, float *lse, int h, int t, int keys,
                    int hd, int causal, float scale, long a0, long a1, long a2, long b0, long b1, long b2, long c0,
                    long c1, long c2) {
        kernel(q, k, v, out, lse, nullptr, nullptr, 0, h, t, keys, hd, causal, scale, a0, a1, a2, b0, b1, b2, c0,
               c1, c2);
    };
}

// q [b, t, h, hd] read as [b, h, t, hd]; k [b, h, keys, hd]; v the first `keys`
// of `keys + 7` positions: the model's layouts, as the GPU test uses them.
// With `split` (and `combine`, `chunk`): decoding's split over keys instead, the
// partials merged.
template <typename T, typename K, typename S = std::nullptr_t, typename C = std::nullptr_t>
void attention_case(int b, int h, int t, int keys, int hd, bool causal, bool bf16, K kernel, int rows = ROWS,
                    const char *name = "attention", S split = nullptr, C combine = nullptr, int chunk = 0,
                    float qstd = 1.0f) {
    auto q = randn(size_t(b) * t * h * hd, qstd), k = randn(size_t(b) * h * keys * hd, 1.5f),
         v = randn(size_t(b) * h * (keys + 7) * hd, 1.0f);
    if (bf16)
        for (auto *a : {&q, &k, &v})
            for (auto &x : *a) x = round_bf16(x);
    const long qs[3] = {long(t) * h * hd, hd, long(h) * hd};
    const long ks[3] = {long(h) * keys * hd, long(keys) * hd, hd};
    const long vs[3] = {long(h) * (keys + 7) * hd, long(keys + 7) * hd, hd};
    auto qd = narrowed<T>(q), kd = narrowed<T>(k), vd = narrowed<T>(v);
    auto out = unwritten<T>(size_t(b) * t * h * hd);
    const float scale = 1.0f / std::sqrt(float(hd));
    if constexpr (std::is_same_v<S, std::nullptr_t>) {
        launch({unsigned((t + rows - 1) / rows), unsigned(h), unsigned(b)}, THREADS, [&] {
            kernel(qd.data(), kd.data(), vd.data(), out.data(), nullptr, h, t, keys, hd, int(causal), scale,
                   qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2]);
        });
    } else {
        const int chunks = (keys + chunk - 1) / chunk;
        const long nrows = long(b) * t * h;
        auto po = unwritten<float>(size_t(chunks) * nrows * hd), pml = unwritten<float>(size_t(chunks) * nrows * 2),
             lse = unwritten<float>(nrows);
        launch({unsigned(chunks), unsigned(h), unsigned(b)}, THREADS, [&] {
            split(qd.data(), kd.data(), vd.data(), nullptr, nullptr, po.data(), pml.data(), chunk, h, t, keys, hd,
                  int(causal), scale, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2]);
        });
        launch({3, 1, 1}, 64, [&] { combine(po.data(), pml.data(), out.data(), lse.data(), chunks, nrows, hd); });
    }
    double worst = 0;
    const int past = keys - t;
    for (int bi = 0; bi < b; ++bi)
        for (int hi = 0; hi < h; ++hi)
            for (int i = 0; i < t; ++i) {
                std::vector<double> p(keys);
                double m = -INFINITY, s = 0;
                for (int j = 0; j < keys; ++j) {
                    double d = 0;
                    for (int c = 0; c < hd; ++c)
                        d += double(q[bi * qs[0] + hi * qs[1] + i * qs[2] + c]) *
                             k[bi * ks[0] + hi * ks[1] + j * ks[2] + c];
                    p[j] = (causal && j > past + i) ? -INFINITY : d * scale;
                    m = std::max(m, p[j]);
                }
                for (auto &x : p) s += (x = std::exp(x - m));
                for (int c = 0; c < hd; ++c) {
                    double o = 0;
                    for (int j = 0; j < keys; ++j) o += p[j] / s * v[bi * vs[0] + hi * vs[1] + j * vs[2] + c];
                    const T g = out[((size_t(bi) * t + i) * h + hi) * hd + c];
                    float gf;
                    if constexpr (std::is_same_v<T, float>) gf = g;
                    else if constexpr (std::is_same_v<T, __half>) gf = __half2float(g);
                    else gf = __bfloat162float(g);
                    const double e = std::abs(gf - o) / std::max(1.0, std::abs(o));
                    worst = std::isfinite(gf) ? std::max(worst, e) : INFINITY;
                }
            }
    // f16 keeps 3 more bits than bf16. f32 scores' rounding grows with their size (qstd);
    // half inputs' own rounding still dominates theirs.
    const double tol = std::is_same_v<T, __half> ? 1.5e-3 : bf16 ? 8e-3 : 1e-5 * qstd;
    char what[200];
    std::snprintf(what, sizeof what, "%s b %d h %d t %d keys %d hd %d causal %d %s: %.3g", name, b, h, t,
                  keys, hd, int(causal), std::is_same_v<T, __half> ? "f16" : bf16 ? "bf16" : "f32", worst);
    std::printf("%s\n", what);
    check(worst < tol, what);
}

// The training kernels on contiguous q, k, v [b, h, n, hd] (the backward's layouts are
// the forward's): the forward's lse, then ∂q, ∂k and ∂v for a random ∂o, against the
// gradient written with the whole probability matrix in double precision,
// ∂s = p ∘ (∂o·vᵀ − Σ_j p ∂o·vᵀ), ∂q = scale·∂s·k, ∂k = scale·∂sᵀ·q, ∂v = pᵀ·∂o.
template <typename T, typename F, typename Q, typename KV>
void attention_grad_case(int b, int h, int t, int keys, int hd, bool causal, bool bf16, F fwd, Q dq_kernel,
                         KV dkv_kernel, int fwd_rows = ROWS, int grad_rows = ROWS) {
    const size_t nq = size_t(b) * h * t * hd, nk = size_t(b) * h * keys * hd;
    auto q = randn(nq, 1.0f), k = randn(nk, 1.5f), v = randn(nk, 1.0f), dout = randn(nq, 1.0f);
    if (bf16)
        for (auto *a : {&q, &k, &v, &dout})
            for (auto &x : *a) x = round_bf16(x);
    auto back = [](T x) -> double {
        if constexpr (std::is_same_v<T, float>) return x;
        else if constexpr (std::is_same_v<T, __half>) return __half2float(x);
        else return __bfloat162float(x);
    };
    // dout arrives as [b, t, h, hd]; the reference below indexes it that way. The kernels
    // get v laid out unlike k, [b, keys, h, hd] (training's v is a view into the stacked
    // q/k/v product, its k a rotated copy), so one reading v by k's strides fails.
    const long qs[3] = {long(h) * t * hd, long(t) * hd, hd};
    const long ks[3] = {long(h) * keys * hd, long(keys) * hd, hd};
    const long vs[3] = {long(keys) * h * hd, hd, long(h) * hd};
    std::vector<float> v_rows(nk);
    for (int bi = 0; bi < b; ++bi)
        for (int hi = 0; hi < h; ++hi)
            for (int j = 0; j < keys; ++j)
                for (int c = 0; c < hd; ++c)
                    v_rows[bi * vs[0] + hi * vs[1] + j * vs[2] + c] = v[((size_t(bi) * h + hi) * keys + j) * hd + c];
    auto qd = narrowed<T>(q), kd = narrowed<T>(k), vd = narrowed<T>(v_rows), dd = narrowed<T>(dout);
    const float scale = 1.0f / std::sqrt(float(hd));
    auto out = unwritten<T>(nq);
    auto lse = unwritten<float>(size_t(b) * t * h);
    launch({unsigned((t + fwd_rows - 1) / fwd_rows), unsigned(h), unsigned(b)}, THREADS, [&] {
        fwd(qd.data(), kd.data(), vd.data(), out.data(), lse.data(), h, t, keys, hd, int(causal), scale,
            qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2]);
    });
    // delta from the kernel's own output, as the op computes it.
    std::vector<float> delta(size_t(b) * t * h);
    for (size_t r = 0; r < delta.size(); ++r) {
        double d = 0;
        for (int c = 0; c < hd; ++c) d += back(out[r * hd + c]) * back(dd[r * hd + c]);
        delta[r] = float(d);
    }
    auto dq = unwritten<T>(nq), dkv = unwritten<T>(2 * nk);
    launch({unsigned((t + grad_rows - 1) / grad_rows), unsigned(h), unsigned(b)}, THREADS, [&] {
        dq_kernel(qd.data(), kd.data(), vd.data(), dd.data(), lse.data(), delta.data(), dq.data(), h, t, keys,
                  hd, int(causal), scale, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2]);
    });
    launch({unsigned((keys + grad_rows - 1) / grad_rows), unsigned(h), unsigned(b)}, THREADS, [&] {
        dkv_kernel(qd.data(), kd.data(), vd.data(), dd.data(), lse.data(), delta.data(), dkv.data(), long(nk),
                   h, t, keys, hd, int(causal), scale, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1],
                   vs[2]);
    });
    double worst_lse = 0, worst_q = 0, worst_k = 0, worst_v = 0;
    const int past = keys - t;
    auto err = [](double &w, double got, double want, double unit) {
        const double e = std::abs(got - want) / std::max(unit, std::abs(want));
        w = std::isfinite(got) ? std::max(w, e) : INFINITY;
    };
    for (int bi = 0; bi < b; ++bi)
        for (int hi = 0; hi < h; ++hi) {
            const size_t qo = (size_t(bi) * h + hi) * t * hd, ko = (size_t(bi) * h + hi) * keys * hd;
            auto dO = [&](int i, int c) { return double(dout[((size_t(bi) * t + i) * h + hi) * hd + c]); };
            std::vector<double> p(size_t(t) * keys, 0.0), ds(size_t(t) * keys, 0.0);
            for (int i = 0; i < t; ++i) {
                double m = -INFINITY, z = 0;
                std::vector<double> s(keys, -INFINITY);
                for (int j = 0; j < keys; ++j) {
                    if (causal && j > past + i) continue;
                    double d = 0;
                    for (int c = 0; c < hd; ++c) d += double(q[qo + i * hd + c]) * k[ko + j * hd + c];
                    s[j] = d * scale;
                    m = std::max(m, s[j]);
                }
                for (int j = 0; j < keys; ++j) z += std::exp(s[j] - m);
                err(worst_lse, lse[(size_t(bi) * t + i) * h + hi], m + std::log(z), 1.0);
                double pdp = 0;
                std::vector<double> dp(keys);
                for (int j = 0; j < keys; ++j) {
                    p[i * keys + j] = std::exp(s[j] - m) / z;
                    double d = 0;
                    for (int c = 0; c < hd; ++c) d += dO(i, c) * v[ko + j * hd + c];
                    dp[j] = d;
                    pdp += p[i * keys + j] * d;
                }
                for (int j = 0; j < keys; ++j) ds[i * keys + j] = p[i * keys + j] * (dp[j] - pdp);
            }
            for (int i = 0; i < t; ++i)
                for (int c = 0; c < hd; ++c) {
                    double g = 0;
                    for (int j = 0; j < keys; ++j) g += ds[i * keys + j] * k[ko + j * hd + c];
                    err(worst_q, back(dq[qo + i * hd + c]), g * scale, 1.0);
                }
            for (int j = 0; j < keys; ++j)
                for (int c = 0; c < hd; ++c) {
                    double gk = 0, gv = 0;
                    for (int i = 0; i < t; ++i) {
                        gk += ds[i * keys + j] * q[qo + i * hd + c];
                        gv += p[i * keys + j] * dO(i, c);
                    }
                    err(worst_k, back(dkv[ko + j * hd + c]), gk * scale, 1.0);
                    err(worst_v, back(dkv[nk + ko + j * hd + c]), gv, 1.0);
                }
        }
    // f32 sums of ~100 terms stay near 1e-6. In bf16, D = ∂o·o comes from the output
    // rounded to 2⁻⁹, and ∂s = p·(dp − D) subtracts numbers of like size: ~1 %, as the
    // GPU test's bf16 tolerance allows (f16 keeps 3 more bits).
    const double tol = std::is_same_v<T, __half> ? 5e-3 : bf16 ? 3e-2 : 2e-5;
    char what[240];
    std::snprintf(what, sizeof what,
                  "attention backward b %d h %d t %d keys %d hd %d causal %d %s: lse %.3g dq %.3g dk %.3g dv %.3g",
                  b, h, t, keys, hd, int(causal), std::is_same_v<T, __half> ? "f16" : bf16 ? "bf16" : "f32", worst_lse,
                  worst_q, worst_k, worst_v);
    std::printf("%s\n", what);
    check(worst_lse < 1e-5 && worst_q < tol && worst_k < tol && worst_v < tol, what);
}

int main() {
    const int cases[][5] = {{2, 3, 70, 70, 64}, {1, 2, 1, 1, 64},    {1, 2, 1, 37, 64},   {2, 2, 5, 133, 128},
                            {1, 4, 33, 33, 8},  {1, 2, 17, 50, 100},  {1, 2, 40, 90, 80},  {1, 2, 20, 20, 96},
                            {1, 2, 40, 150, 48},
                            {1, 1, 40, 40, 256}, {1, 2, 65, 97, 200}};
    for (auto &c : cases)
        for (int causal = 0; causal < 2; ++causal) {
            const int b = c[0], h = c[1], t = c[2], keys = c[3], hd = c[4];
            auto f32 = one_pass(hd <= 64    ? flash_attention_f32_d64
                                : hd <= 128 ? flash_attention_f32_d128
                                            : flash_attention_f32_d256);
            auto b16 = one_pass(hd <= 64    ? flash_attention_bf16_d64
                                : hd <= 128 ? flash_attention_bf16_d128
                                            : flash_attention_bf16_d256);
            attention_case<float>(b, h, t, keys, hd, causal, false, f32);
            if (hd <= 64) // the register-tiled f32 forward
                attention_case<float>(b, h, t, keys, hd, causal, false, flash_tile_f32_d64, TILE_Q,
                                      "attention (f32 tiles)");
            attention_case<__nv_bfloat16>(b, h, t, keys, hd, causal, true, b16);
            if (hd <= 128) { // the tensor-core forward, on the bf16 values in bf16 and in f16
                attention_case<__nv_bfloat16>(b, h, t, keys, hd, causal, true,
                                              hd <= 64   ? flash_tc_bf16_d64
                                              : hd <= 96 ? flash_tc_bf16_d96
                                                         : flash_tc_bf16_d128,
                                              TC_ROWS, "attention (tensor cores)");
                attention_case<__half>(b, h, t, keys, hd, causal, true,
                                       hd <= 64   ? flash_tc_f16_d64
                                       : hd <= 96 ? flash_tc_f16_d96
                                                  : flash_tc_f16_d128,
                                       TC_ROWS, "attention (tensor cores)");
            }
        }
    // Scores far past expf's range (q 30 times larger: about ±150 after scaling), which
    // only subtracting each row's maximum keeps finite, in every forward kernel.
    for (int causal = 0; causal < 2; ++causal) {
        const char *big = "attention (huge scores)";
        attention_case<float>(1, 2, 40, 90, 64, causal, false, one_pass(flash_attention_f32_d64), ROWS, big,
                              nullptr, nullptr, 0, 30.0f);
        attention_case<float>(1, 2, 40, 90, 64, causal, false, flash_tile_f32_d64, TILE_Q, big, nullptr, nullptr, 0,
                              30.0f);
        attention_case<__nv_bfloat16>(1, 2, 40, 90, 64, causal, true, flash_tc_bf16_d64, TC_ROWS, big, nullptr,
                                      nullptr, 0, 30.0f);
    }
    // Decoding's split over keys: one query and a few (causal, so some rows see nothing
    // of the last chunks), chunks of whole and ragged tiles, each instance's head sizes.
    const int split_cases[][6] = {{1, 2, 1, 300, 64, 64}, {2, 1, 3, 133, 128, 40}, {1, 1, 32, 70, 256, 16},
                                  {1, 2, 1, 1, 64, 64}};
    for (auto &c : split_cases)
        for (int causal = 0; causal < 2; ++causal) {
            const int b = c[0], h = c[1], t = c[2], keys = c[3], hd = c[4], chunk = c[5];
            auto fs = hd <= 64 ? flash_attention_f32_d64 : hd <= 128 ? flash_attention_f32_d128 : flash_attention_f32_d256;
            auto bs = hd <= 64    ? flash_attention_bf16_d64
                      : hd <= 128 ? flash_attention_bf16_d128
                                  : flash_attention_bf16_d256;
            attention_case<float>(b, h, t, keys, hd, causal, false, nullptr, ROWS, "attention (split keys)", fs,
                                  flash_combine_f32, chunk);
            attention_case<__nv_bfloat16>(b, h, t, keys, hd, causal, true, nullptr, ROWS,
                                          "attention (split keys)", bs, flash_combine_bf16, chunk);
        }
    // The backward: square (training's case) with ragged tiles of queries and keys, a
    // longer past, one query, and each instance's head sizes.
    const int grad_cases[][5] = {{2, 2, 70, 70, 64}, {1, 1, 1, 1, 64},   {1, 2, 5, 133, 128},
                                 {1, 3, 33, 33, 8},  {1, 2, 20, 150, 48}, {1, 1, 9, 30, 20},
                                 {1, 1, 40, 40, 256}, {1, 2, 65, 97, 200}};
    for (auto &c : grad_cases)
        for (int causal = 0; causal < 2; ++causal) {
            const int b = c[0], h = c[1], t = c[2], keys = c[3], hd = c[4];
            if (hd <= 64) {
                attention_grad_case<float>(b, h, t, keys, hd, causal, false, one_pass(flash_attention_f32_d64),
                                           flash_dq_f32_d64, flash_dkv_f32_d64);
                // From the register-tiled forward's log-sum-exp, as f32 training runs.
                attention_grad_case<float>(b, h, t, keys, hd, causal, false, flash_tile_f32_d64, flash_dq_f32_d64,
                                           flash_dkv_f32_d64, TILE_Q);
                attention_grad_case<__nv_bfloat16>(b, h, t, keys, hd, causal, true, one_pass(flash_attention_bf16_d64),
                                                   flash_dq_bf16_d64, flash_dkv_bf16_d64);
                // The SIMT backward from the tensor-core forward's log-sum-exp, then the
                // tensor-core backward, as bf16 and f16 training run.
                attention_grad_case<__nv_bfloat16>(b, h, t, keys, hd, causal, true, flash_tc_bf16_d64,
                                                   flash_dq_bf16_d64, flash_dkv_bf16_d64, TC_ROWS);
                attention_grad_case<__nv_bfloat16>(b, h, t, keys, hd, causal, true, flash_tc_bf16_d64,
                                                   flash_tc_dq_bf16_d64, flash_tc_dkv_bf16_d64, TC_ROWS, TC_ROWS);
                attention_grad_case<__half>(b, h, t, keys, hd, causal, true, flash_tc_f16_d64,
                                            flash_tc_dq_f16_d64, flash_tc_dkv_f16_d64, TC_ROWS, TC_ROWS);
            } else if (hd <= 128) {
                attention_grad_case<float>(b, h, t, keys, hd, causal, false, one_pass(flash_attention_f32_d128),
                                           flash_dq_f32_d128, flash_dkv_f32_d128);
            } else {
                attention_grad_case<float>(b, h, t, keys, hd, causal, false, one_pass(flash_attention_f32_d256),
                                           flash_dq_f32_d256, flash_dkv_f32_d256);
            }
        }
    std::printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
    return failures != 0;
}
#endif

#ifdef LOGPROB
namespace { // internal linkage: see "Kernels in an unnamed namespace" above
#include "../../src/kernels/cuda/logprob.cu"
} // namespace

int main() {
    for (int vocab : {1, 31, 777, 1000, 50304}) {
        const int n = 37;
        auto x = randn(size_t(n) * vocab, 4.0f);
        std::vector<unsigned> tg(n);
        for (int i = 0; i < n; ++i) tg[i] = unsigned((i * 7919 + 3) % vocab);
        if (vocab >= 31) {
            std::fill(x.begin(), x.begin() + vocab, 0.25f);
            x[vocab + 5] = x[vocab + 9] = 30.0f;
            std::fill(x.begin() + 2 * vocab, x.begin() + 4 * vocab, -INFINITY);
            for (int r : {2, 3}) x[r * vocab + 3] = x[r * vocab + 20] = 1.0f;
            tg[2] = 3;
            tg[3] = 4;
            // Rows a broken model gives: one NaN among finite logits, one +inf, all NaN.
            // Each must come out non-finite (scoring refuses it), never a finite number.
            x[4 * vocab + 7] = NAN;
            x[5 * vocab + 8] = INFINITY;
            std::fill(x.begin() + 6 * vocab, x.begin() + 7 * vocab, NAN);
        }
        const auto special = [vocab](int r) { return vocab >= 31 && r >= 4 && r <= 6; };
        for (int bf16 = 0; bf16 < 2; ++bf16) {
            std::vector<float> xr = x;
            if (bf16)
                for (auto &v : xr) v = round_bf16(v);
            std::vector<__nv_bfloat16> xb(xr.size());
            for (size_t i = 0; i < xr.size(); ++i) xb[i] = __float2bfloat16(xr[i]);
            auto out = unwritten<float>(3 * n);
            unsigned threads = 32;
            while (threads < unsigned(vocab) && threads < 512) threads *= 2;
            launch({unsigned(n), 1, 1}, threads, [&] {
                if (bf16) logprob_bf16(xb.data(), tg.data(), out.data(), vocab);
                else logprob_f32(xr.data(), tg.data(), out.data(), vocab);
            });
            double worst = 0;
            for (int r = 0; r < n; ++r) {
                if (special(r)) {
                    check(!std::isfinite(out[3 * r]) && !std::isfinite(out[3 * r + 1]),
                          "row " + std::to_string(r) + " of NaN or inf logits gives finite results");
                    continue;
                }
                const float *row = xr.data() + size_t(r) * vocab;
                double m = -INFINITY, s = 0;
                int arg = 0;
                for (int i = 0; i < vocab; ++i)
                    if (row[i] > m) m = row[i], arg = i;
                for (int i = 0; i < vocab; ++i) s += std::exp(row[i] - m);
                const double lse = m + std::log(s), lp = row[tg[r]] - lse;
                auto err = [](double g, double w) {
                    if (!std::isfinite(w)) return g == w ? 0.0 : INFINITY;
                    return std::abs(g - w) / std::max(1.0, std::abs(w));
                };
                worst = worse(worse(worst, err(out[3 * r], lp)), err(out[3 * r + 1], lse));
                check(out[3 * r + 2] == float(arg), "argmax row " + std::to_string(r) + " vocab " +
                                                        std::to_string(vocab));
            }
            char what[120];
            std::snprintf(what, sizeof what, "logprob vocab %d %s: %.3g", vocab, bf16 ? "bf16" : "f32", worst);
            std::printf("%s\n", what);
            check(worst < 1e-5, what);
            if (vocab >= 31) {
                check(out[2] == 0.0f && out[5] == 5.0f, "ties go to the first index");
                check(std::abs(out[6] + std::log(2.0)) < 1e-6 && out[9] == -INFINITY, "-inf logits");
            }
            // The backward from this lse: a · softmax − b · one-hot, against double.
            std::vector<float> coef(3 * n);
            for (int r = 0; r < n; ++r) {
                coef[3 * r] = 0.5f + 0.1f * float(r % 5);
                coef[3 * r + 1] = 0.75f - 0.05f * float(r % 7);
                coef[3 * r + 2] = out[3 * r + 1];
            }
            auto g = unwritten<float>(xr.size());
            auto gb = unwritten<__nv_bfloat16>(xr.size());
            launch({unsigned(n), 1, 1}, threads, [&] {
                if (bf16) logprob_grad_bf16(xb.data(), tg.data(), coef.data(), gb.data(), vocab);
                else logprob_grad_f32(xr.data(), tg.data(), coef.data(), g.data(), vocab);
            });
            double worst_g = 0;
            for (int r = 0; r < n; ++r) {
                if (special(r)) continue;
                const float *row = xr.data() + size_t(r) * vocab;
                double m = -INFINITY, s = 0;
                for (int i = 0; i < vocab; ++i) m = std::max(m, double(row[i]));
                for (int i = 0; i < vocab; ++i) s += std::exp(row[i] - m);
                for (int i = 0; i < vocab; ++i) {
                    const double p = std::exp(row[i] - m) / s;
                    const double want = coef[3 * r] * p - (unsigned(i) == tg[r] ? coef[3 * r + 1] : 0.0);
                    const double got = bf16 ? __bfloat162float(gb[size_t(r) * vocab + i]) : g[size_t(r) * vocab + i];
                    worst_g = worse(worst_g, std::abs(got - want));
                }
            }
            std::snprintf(what, sizeof what, "logprob_grad vocab %d %s: %.3g", vocab, bf16 ? "bf16" : "f32", worst_g);
            std::printf("%s\n", what);
            check(worst_g < (bf16 ? 4e-3 : 1e-6), what);
        }
    }
    std::printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
    return failures != 0;
}
#endif

#ifdef THETA
namespace { // internal linkage: see "Kernels in an unnamed namespace" above
#include "../../src/kernels/cuda/theta.cu"
} // namespace

int main() {
    for (int n : {1, 31, 1000, 1500}) {
        const int rows = 5;
        auto x = randn(size_t(rows) * n, 3.0f);
        // The last row all zeros: 0 for both GELU variants (not 0/0), 1 = n/n for softmax.
        std::fill(x.end() - n, x.end(), 0.0f);
        for (int act = 0; act < 3; ++act) {
            const float scale = act == 2 ? float(n) : std::sqrt(float(n));
            auto out = unwritten<float>(x.size());
            unsigned threads = 32;
            while (threads < unsigned(n) && threads < 1024) threads *= 2;
            launch({unsigned(rows), 1, 1}, threads, [&] { theta_f32(x.data(), out.data(), n, scale, act); });
            auto g = [](double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); };
            double worst = 0;
            for (int r = 0; r < rows; ++r) {
                const float *s = x.data() + size_t(r) * n;
                std::vector<double> want(n);
                if (act == 2) {
                    double m = -INFINITY, z = 0;
                    for (int i = 0; i < n; ++i) m = std::max(m, double(s[i]));
                    for (int i = 0; i < n; ++i) z += std::exp(s[i] - m);
                    for (int i = 0; i < n; ++i) want[i] = std::exp(s[i] - m) / z * scale;
                } else {
                    double ss = 0;
                    for (int i = 0; i < n; ++i) ss += act == 0 ? double(s[i]) * s[i] : g(s[i]) * g(s[i]);
                    const double f = scale / std::max(std::sqrt(ss), 1e-30);
                    for (int i = 0; i < n; ++i) want[i] = act == 0 ? g(s[i] * f) : g(s[i]) * f;
                }
                for (int i = 0; i < n; ++i)
                    worst = worse(worst, std::abs(out[size_t(r) * n + i] - want[i]) / std::max(1.0, std::abs(want[i])));
            }
            char what[80];
            std::snprintf(what, sizeof what, "theta n %d act %d: %.3g", n, act, worst);
            std::printf("%s\n", what);
            check(worst < 1e-5, what);
            // The bf16 and f16 instances (their loads and stores): every sum is in f32
            // whatever the dtype, so each must give exactly the f32 kernel's result on the
            // same rounded scores, rounded once to the dtype.
            const auto rounded_case = [&](auto zero, const char *dtype, auto kernel) {
                using T = decltype(zero);
                const auto xt = narrowed<T>(x);
                const auto xr = widened(xt);
                auto ref = unwritten<float>(x.size());
                auto out = unwritten<T>(x.size());
                launch({unsigned(rows), 1, 1}, threads, [&] {
                    theta_f32(xr.data(), ref.data(), n, scale, act);
                    kernel(xt.data(), out.data(), n, scale, act);
                });
                const size_t differ = differ_from_rounded(out, ref);
                std::snprintf(what, sizeof what, "theta n %d act %d %s: %zu of %zu differ from f32's, rounded", n,
                              act, dtype, differ, x.size());
                std::printf("%s\n", what);
                check(differ == 0, what);
            };
            rounded_case(__nv_bfloat16{}, "bf16", theta_bf16);
            rounded_case(__half{}, "f16", theta_f16);
        }
    }
    // act 0's backward against central differences of Σ Θ(s)·w in double, the last
    // row all zeros (there ∂L/∂s = f·w·GELU′(0), the clamped norm a constant).
    for (int n : {1, 31, 1000, 1500}) {
        const int rows = 4;
        auto x = randn(size_t(rows) * n, 3.0f);
        auto w = randn(x.size(), 1.0f);
        std::fill(x.end() - n, x.end(), 0.0f);
        const float scale = std::sqrt(float(n));
        auto out = unwritten<float>(x.size());
        unsigned threads = 32;
        while (threads < unsigned(n) && threads < 1024) threads *= 2;
        launch({unsigned(rows), 1, 1}, threads, [&] { theta_grad_f32(x.data(), w.data(), out.data(), n, scale); });
        auto g = [](double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); };
        // Σ_i Θ(row)_i · w_i in double, for one row.
        auto loss = [&](const std::vector<double> &s, const float *wr) {
            double ss = 0, l = 0;
            for (double v : s) ss += v * v;
            const double f = scale / std::max(std::sqrt(ss), 1e-30);
            for (int i = 0; i < n; ++i) l += g(s[i] * f) * wr[i];
            return l;
        };
        double worst = 0;
        for (int r = 0; r < rows - 1; ++r) {
            const float *wr = w.data() + size_t(r) * n;
            std::vector<double> s(x.begin() + size_t(r) * n, x.begin() + size_t(r + 1) * n);
            for (int i = 0; i < n; i += std::max(1, n / 40)) {
                const double h = 1e-4 * std::max(1.0, std::abs(s[i]));
                auto p = s, m = s;
                p[i] += h;
                m[i] -= h;
                const double want = (loss(p, wr) - loss(m, wr)) / (2 * h);
                worst = worse(worst, std::abs(out[size_t(r) * n + i] - want) / std::max(1.0, std::abs(want)));
            }
        }
        double zero = 0;
        for (int i = 0; i < n; ++i) {
            const double want = double(scale) / 1e-30f * 0.5 * w[size_t(rows - 1) * n + i];
            zero = std::max(zero, std::abs(out[size_t(rows - 1) * n + i] - want) / std::abs(want));
        }
        char what[96];
        std::snprintf(what, sizeof what, "theta_grad n %d: %.3g, zero row %.3g", n, worst, zero);
        std::printf("%s\n", what);
        check(worst < 1e-4 && zero < 1e-6, what);
        // The bf16 and f16 instances: exactly the f32 kernel's result on the same
        // rounded scores and gradients, rounded once (as the forward's above).
        const auto rounded_case = [&](auto zero, const char *dtype, auto kernel) {
            using T = decltype(zero);
            const auto st = narrowed<T>(x), wt = narrowed<T>(w);
            const auto sr = widened(st), wr = widened(wt);
            auto ref = unwritten<float>(x.size());
            auto out = unwritten<T>(x.size());
            launch({unsigned(rows), 1, 1}, threads, [&] {
                theta_grad_f32(sr.data(), wr.data(), ref.data(), n, scale);
                kernel(st.data(), wt.data(), out.data(), n, scale);
            });
            const size_t differ = differ_from_rounded(out, ref);
            std::snprintf(what, sizeof what, "theta_grad n %d %s: %zu of %zu differ from f32's, rounded", n, dtype,
                          differ, x.size());
            std::printf("%s\n", what);
            check(differ == 0, what);
        };
        rounded_case(__nv_bfloat16{}, "bf16", theta_grad_bf16);
        rounded_case(__half{}, "f16", theta_grad_f16);
    }
    std::printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
    return failures != 0;
}
#endif

#ifdef SOFTMAX
namespace { // internal linkage: see "Kernels in an unnamed namespace" above
#include "../../src/kernels/cuda/softmax.cu"
} // namespace

// softmax(scale · s) of one row over its first `seen` entries (0 after), in double.
std::vector<double> softmax_ref(const float *s, int n, int seen, double scale) {
    std::vector<double> y(n, 0.0);
    double m = -INFINITY, z = 0;
    for (int i = 0; i < seen; ++i) m = std::max(m, scale * s[i]);
    if (m == -INFINITY) return y;  // nothing seen: zeros
    for (int i = 0; i < seen; ++i) z += std::exp(scale * s[i] - m);
    for (int i = 0; i < seen; ++i) y[i] = std::exp(scale * s[i] - m) / z;
    return y;
}

int main() {
    const float scale = 0.125f;
    // (queries, keys): square, a cached past (keys > queries), one query, a long row.
    for (auto [queries, n] : {std::pair{7, 7}, {5, 12}, {1, 40}, {3, 1500}}) {
        for (int causal = 0; causal < 2; ++causal) {
            const int rows = 2 * queries;  // two heads
            auto s = randn(size_t(rows) * n, 8.0f);
            if (!causal) {
                // Masks added as −∞ (the merged model's image rows): one entry of every
                // even row, and all of row 1, which must give zeros rather than 0/0.
                for (int r = 0; r < rows; r += 2) s[size_t(r) * n + r % n] = -INFINITY;
                std::fill(s.begin() + n, s.begin() + 2 * size_t(n), -INFINITY);
            }
            auto w = randn(s.size(), 1.0f);
            auto y = unwritten<float>(s.size()), ds = unwritten<float>(s.size());
            unsigned threads = 32;
            while (threads < unsigned(n) && threads < 1024) threads *= 2;
            launch({unsigned(rows), 1, 1}, threads,
                   [&] { softmax_f32(s.data(), y.data(), n, scale, queries, causal); });
            launch({unsigned(rows), 1, 1}, threads,
                   [&] { softmax_grad_f32(y.data(), w.data(), ds.data(), n, scale); });
            double worst_y = 0, worst_g = 0;
            for (int r = 0; r < rows; ++r) {
                const int seen = causal ? r % queries + (n - queries) + 1 : n;
                const float *sr = s.data() + size_t(r) * n, *wr = w.data() + size_t(r) * n;
                auto want = softmax_ref(sr, n, seen, scale);
                for (int i = 0; i < n; ++i) {
                    const double got = y[size_t(r) * n + i];
                    worst_y = worse(worst_y, std::abs(got - want[i]));
                    if (i >= seen || sr[i] == -INFINITY) check(got == 0.0, "a masked weight is not 0");
                    if (sr[i] == -INFINITY) check(ds[size_t(r) * n + i] == 0.0, "a masked gradient is not 0");
                }
                // ∂/∂s_i of Σ softmax(scale · s)·w by central differences.
                std::vector<float> p(sr, sr + n);
                for (int i = 0; i < n; i += std::max(1, n / 30)) {
                    const float h = 1e-2f;
                    auto loss = [&](float v) {
                        p[i] = v;
                        auto y = softmax_ref(p.data(), n, seen, scale);
                        double l = 0;
                        for (int j = 0; j < n; ++j) l += y[j] * wr[j];
                        return l;
                    };
                    const double fd = (loss(sr[i] + h) - loss(sr[i] - h)) / (2.0 * h);
                    p[i] = sr[i];
                    worst_g = worse(worst_g, std::abs(ds[size_t(r) * n + i] - fd));
                }
            }
            char what[96];
            std::snprintf(what, sizeof what, "softmax %dx%d causal %d: values %.3g, gradient %.3g", queries, n,
                          causal, worst_y, worst_g);
            std::printf("%s\n", what);
            check(worst_y < 1e-6 && worst_g < 1e-5, what);
        }
    }
    std::printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
    return failures != 0;
}
#endif

#ifdef NORM
namespace { // internal linkage: see "Kernels in an unnamed namespace" above
#include "../../src/kernels/cuda/norm.cu"
} // namespace

int main() {
    const float eps = 1e-5f;
    for (int n : {1, 31, 768, 1500}) {
        const int rows = 4;
        auto x = randn(size_t(rows) * n, 2.0f);
        for (auto &v : x) v += 5.0f;  // an offset the mean must remove
        std::fill(x.end() - n, x.end(), 0.75f);  // a constant row: variance 0
        // Another, whose f32 sums are inexact: E[x²] − mean² would come out below −eps
        // (NaN) here; about the mean it is (x − mean)/√eps with x − mean a rounding.
        std::fill(x.begin() + n, x.begin() + 2 * size_t(n), 3.3f);
        auto w = randn(x.size(), 1.0f);
        auto y = unwritten<float>(x.size()), dx = unwritten<float>(x.size());
        unsigned threads = 32;
        while (threads < unsigned(n) && threads < 1024) threads *= 2;
        launch({unsigned(rows), 1, 1}, threads, [&] { layer_norm_f32(x.data(), y.data(), n, eps); });
        launch({unsigned(rows), 1, 1}, threads, [&] { layer_norm_grad_f32(x.data(), w.data(), dx.data(), n, eps); });
        // LN(row) in double and Σ LN(row)·w.
        auto ln = [&](const std::vector<double> &r) {
            double mean = 0, var = 0;
            for (double v : r) mean += v;
            mean /= n;
            for (double v : r) var += (v - mean) * (v - mean);
            var /= n;
            std::vector<double> out(n);
            for (int i = 0; i < n; ++i) out[i] = (r[i] - mean) / std::sqrt(var + eps);
            return out;
        };
        double worst_y = 0, worst_g = 0;
        for (int r = 0; r < rows; ++r) {
            std::vector<double> row(x.begin() + size_t(r) * n, x.begin() + size_t(r + 1) * n);
            const float *wr = w.data() + size_t(r) * n;
            auto want = ln(row);
            for (int i = 0; i < n; ++i) {
                const double e = std::abs(y[size_t(r) * n + i] - want[i]);
                if (r == 1) check(e < 1e-3, "layer_norm of a constant row of 3.3 is not about 0");
                else worst_y = worse(worst_y, e);
            }
            auto loss = [&](const std::vector<double> &v) {
                auto o = ln(v);
                double l = 0;
                for (int i = 0; i < n; ++i) l += o[i] * wr[i];
                return l;
            };
            for (int i = 0; i < n; i += std::max(1, n / 40)) {
                const double h = 1e-4;
                auto p = row, m = row;
                p[i] += h;
                m[i] -= h;
                const double fd = (loss(p) - loss(m)) / (2 * h);
                worst_g = worse(worst_g, std::abs(dx[size_t(r) * n + i] - fd) / std::max(1.0, std::abs(fd)));
            }
        }
        char what[96];
        std::snprintf(what, sizeof what, "layer_norm n %d: values %.3g, gradient %.3g", n, worst_y, worst_g);
        std::printf("%s\n", what);
        check(worst_y < 2e-5 && worst_g < 2e-4, what);
        // The residual and the norm in one pass: out [2, rows, n], the sum bit for bit,
        // then the rows of the sum normalised as layer_norm_f32 does them.
        auto a = randn(x.size(), 1.0f);
        auto both = unwritten<float>(2 * x.size()), ln_sum = unwritten<float>(x.size());
        std::vector<float> sum(x.size());
        for (size_t i = 0; i < x.size(); ++i) sum[i] = x[i] + a[i];
        launch({unsigned(rows), 1, 1}, threads,
               [&] { add_layer_norm_f32(x.data(), a.data(), both.data(), n, eps); });
        launch({unsigned(rows), 1, 1}, threads, [&] { layer_norm_f32(sum.data(), ln_sum.data(), n, eps); });
        long differ = 0;
        for (size_t i = 0; i < x.size(); ++i)
            differ += (both[i] != sum[i]) + (both[x.size() + i] != ln_sum[i]);
        std::snprintf(what, sizeof what, "add_layer_norm n %d: %ld elements differ", n, differ);
        std::printf("%s\n", what);
        check(differ == 0, what);
    }
    std::printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
    return failures != 0;
}
#endif

#ifdef ADAMW
namespace { // internal linkage: see "Kernels in an unnamed namespace" above
#include "../../src/kernels/cuda/adamw.cu"
} // namespace

// The multi-tensor kernels on three tensors (one of them with frozen leading elements)
// cut into pieces of at most `piece` elements, as train/optim/in_place/cuda.rs cuts
// them: the AdamW step and the clipping scale against the CPU's arithmetic bit for bit,
// the sum of squares against a double-precision sum.
void multi_tensor_cases() {
    const long sizes[3] = {1, 1000, 70001}, from[3] = {0, 0, 700};
    const float keeps[3] = {1.0f, 1.0f - 1e-3f * 0.1f, 1.0f - 1e-3f * 0.1f};
    for (long piece : {64L, 4096L}) {
        std::vector<std::vector<float>> theta, m, v, g, wt, wm, wv, scaled;
        std::vector<unsigned long long> step_table, sum_table, scale_table;
        const float b1 = 0.9f, c1 = 0.1f, b2 = 0.95f, c2 = 1.0f - 0.95f, sbc2 = std::sqrt(1.0f - 0.95f * 0.95f),
                    eps = 1e-8f, step = 1e-3f / (1.0f - 0.9f * 0.9f), k = 0.37f;
        for (int j = 0; j < 3; ++j) {
            theta.push_back(randn(sizes[j], 0.5f));
            m.push_back(randn(sizes[j], 0.1f));
            v.push_back(randn(sizes[j], 0.01f));
            g.push_back(randn(sizes[j], 1.0f));
            for (auto &x : v[j]) x = std::abs(x);
            scaled.push_back(unwritten<float>(sizes[j]));
        }
        wt = theta, wm = m, wv = v;
        double want_sq = 0.0;
        for (int j = 0; j < 3; ++j) {
            for (long i = 0; i < sizes[j]; ++i) want_sq += double(g[j][i]) * g[j][i];
            for (long i = from[j]; i < sizes[j]; ++i) {
                wm[j][i] = wm[j][i] * b1 + g[j][i] * c1;
                wv[j][i] = wv[j][i] * b2 + g[j][i] * g[j][i] * c2;
                wt[j][i] = wt[j][i] * keeps[j] - wm[j][i] / (std::sqrt(wv[j][i]) / sbc2 + eps) * step;
            }
            auto addr = [](const std::vector<float> &x, long at) {
                return (unsigned long long)(uintptr_t)(x.data() + at);
            };
            for (long at = 0; at < sizes[j]; at += piece) {
                const unsigned long long n = std::min(piece, sizes[j] - at);
                sum_table.insert(sum_table.end(), {addr(g[j], at), n});
                scale_table.insert(scale_table.end(), {addr(g[j], at), addr(scaled[j], at), n});
            }
            unsigned keep_bits;
            std::memcpy(&keep_bits, &keeps[j], 4);
            for (long at = from[j]; at < sizes[j]; at += piece) {
                const unsigned long long n = std::min(piece, sizes[j] - at);
                step_table.insert(step_table.end(), {addr(theta[j], at), addr(m[j], at), addr(v[j], at),
                                                     addr(g[j], at), n, keep_bits});
            }
        }
        const unsigned steps = step_table.size() / 6, sums = sum_table.size() / 2, scales = scale_table.size() / 3;
        launch({steps, 1, 1}, 64, [&] { adamw_step_multi(step_table.data(), b1, c1, b2, c2, sbc2, eps, step); });
        auto partial = unwritten<double>(sums);
        launch({sums, 1, 1}, 96, [&] { sum_sq_multi(sum_table.data(), partial.data()); });
        launch({scales, 1, 1}, 64, [&] { scale_multi(scale_table.data(), k); });
        long differ = 0;
        for (int j = 0; j < 3; ++j)
            for (long i = 0; i < sizes[j]; ++i)
                differ += (m[j][i] != wm[j][i]) + (v[j][i] != wv[j][i]) + (theta[j][i] != wt[j][i]) +
                          (scaled[j][i] != g[j][i] * k);
        double sq = 0.0;
        for (double x : partial) sq += x;
        const double rel = std::abs(sq - want_sq) / want_sq;
        char what[160];
        std::snprintf(what, sizeof what,
                      "multi-tensor, pieces of %ld (%u, %u, %u blocks): %ld elements differ, sum of squares %.2g",
                      piece, steps, sums, scales, differ, rel);
        std::printf("%s\n", what);
        check(differ == 0 && rel < 1e-12, what);
    }
}

// The two passes against train/optim/in_place.rs's CPU arithmetic (the same operations
// in f32), bit for bit, with a grid smaller than the tensor (the grid-stride loop) and
// larger.
int main() {
    for (long n : {1L, 1000L, 70001L})
        for (unsigned blocks : {2u, 300u}) {
            auto theta = randn(n, 0.5f), m = randn(n, 0.1f), v = randn(n, 0.01f), g = randn(n, 1.0f);
            for (auto &x : v) x = std::abs(x);
            const float b1 = 0.9f, c1 = 0.1f, b2 = 0.999f, c2 = 1.0f - 0.999f;
            const float keep = 1.0f - 1e-3f * 0.01f, sbc2 = std::sqrt(1.0f - 0.999f), eps = 1e-8f,
                        step = 1e-3f / (1.0f - 0.9f);
            auto wm = m, wv = v, wt = theta;
            for (long i = 0; i < n; ++i) {
                wm[i] = wm[i] * b1 + g[i] * c1;
                wv[i] = wv[i] * b2 + g[i] * g[i] * c2;
                wt[i] = wt[i] * keep - wm[i] / (std::sqrt(wv[i]) / sbc2 + eps) * step;
            }
            launch({blocks, 1, 1}, 32, [&] { adamw_moment(m.data(), g.data(), n, b1, c1, 0); });
            launch({blocks, 1, 1}, 32, [&] { adamw_moment(v.data(), g.data(), n, b2, c2, 1); });
            launch({blocks, 1, 1}, 32, [&] {
                adamw_apply(theta.data(), m.data(), v.data(), n, keep, sbc2, eps, step);
            });
            long differ = 0;
            for (long i = 0; i < n; ++i)
                differ += (m[i] != wm[i]) + (v[i] != wv[i]) + (theta[i] != wt[i]);
            char what[120];
            std::snprintf(what, sizeof what, "adamw n %ld, %u blocks of 32: %ld elements differ", n, blocks,
                          differ);
            std::printf("%s\n", what);
            check(differ == 0, what);
        }
    multi_tensor_cases();
    std::printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
    return failures != 0;
}
#endif

#ifdef ROTARY
namespace { // internal linkage: see "Kernels in an unnamed namespace" above
#include "../../src/kernels/cuda/rotary.cu"
} // namespace

// Queries and keys as a fused q/k/v product leaves them (x [2, b, h, t, hd] over a
// [3, b, t, h, hd] buffer) against the CPU kernel's formula, bit for bit in f32 and
// bf16, at a position offset, with unrotated features, a grid smaller than the
// tensor (the grid-stride loop) and larger.
int main() {
    const int b = 2, t = 3, h = 4, hd = 16, positions = 12, offset = 7;
    for (int dims : {16, 4})
        for (unsigned blocks : {3u, 40u}) {
            const int half = dims / 2;
            auto qkv = randn(size_t(3) * b * t * h * hd, 1.0f);
            auto ang = randn(size_t(positions) * half, 3.0f);
            std::vector<float> cos(ang.size()), sin(ang.size());
            for (size_t i = 0; i < ang.size(); ++i) cos[i] = std::cos(ang[i]), sin[i] = std::sin(ang[i]);
            // [n, b, h, t, hd] strides over [3, b, t, h, hd].
            const long s3 = long(h) * hd, s2 = hd, s1 = long(t) * h * hd, s0 = long(b) * s1;
            const long total = 2L * b * h * t * hd;
            auto y = unwritten<float>(total);
            std::vector<float> want(total);
            std::vector<__nv_bfloat16> xb(qkv.size());
            auto yb = unwritten<__nv_bfloat16>(total);
            for (size_t i = 0; i < qkv.size(); ++i) xb[i] = __float2bfloat16(qkv[i]);
            long differ = 0, differ_bf16 = 0;
            for (int pass = 0; pass < 2; ++pass) {
                // Widened inputs: the f32 values, then the bf16 ones.
                auto in = [&](long i) { return pass == 0 ? qkv[i] : __bfloat162float(xb[i]); };
                long i = 0;
                for (int n = 0; n < 2; ++n)
                    for (int bb = 0; bb < b; ++bb)
                        for (int hh = 0; hh < h; ++hh)
                            for (int tt = 0; tt < t; ++tt)
                                for (int j = 0; j < hd; ++j, ++i) {
                                    const long row = n * s0 + bb * s1 + hh * s2 + tt * s3;
                                    const long p = long(offset + tt) * half;
                                    float v = in(row + j);
                                    if (j < half)
                                        v = in(row + j) * cos[p + j] - in(row + j + half) * sin[p + j];
                                    else if (j < dims)
                                        v = in(row + j) * cos[p + j - half] + in(row + j - half) * sin[p + j - half];
                                    want[i] = v;
                                }
                if (pass == 0) {
                    launch({blocks, 1, 1}, 64, [&] {
                        rotary_heads_f32(qkv.data(), y.data(), cos.data(), sin.data(), b, h, t, hd, dims, offset,
                                         s0, s1, s2, s3, total);
                    });
                    for (long k = 0; k < total; ++k) differ += y[k] != want[k];
                } else {
                    launch({blocks, 1, 1}, 64, [&] {
                        rotary_heads_bf16(xb.data(), yb.data(), cos.data(), sin.data(), b, h, t, hd, dims, offset,
                                          s0, s1, s2, s3, total);
                    });
                    for (long k = 0; k < total; ++k) differ_bf16 += yb[k].x != __float2bfloat16(want[k]).x;
                }
            }
            char what[120];
            std::snprintf(what, sizeof what, "rotary dims %d, %u blocks of 64: %ld f32 and %ld bf16 elements differ",
                          dims, blocks, differ, differ_bf16);
            std::printf("%s\n", what);
            check(differ == 0 && differ_bf16 == 0, what);
        }
    std::printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
    return failures != 0;
}
#endif

#ifdef CANARY
// The checks' own tests. The race check's (run.sh expects the first two to be
// reported): `shuffle`, lane 0 writes shared memory and lane 1 reads it after a
// shuffle, which orders nothing on a GPU; `blocks`, thread 0 of two blocks writes one
// element; `barrier`, lane 1 reads lane 0's write after a block barrier, which is no
// race. The out-of-bounds check's (EMULATE_ASAN): `past`, lane 31 writes one element
// past the output, which must be reported; `barrier` again, which must not. The value
// check's, in a plain build: `unwritten`, lane 1 reads shared memory nobody wrote, and
// `unset`, nobody writes the output; both must fail (exit 1), `barrier` must pass.
namespace { // where the kernels' shared arrays are (see shared.ld)
void canary(const std::string &mode, float *out) {
    __shared__ float word;
    if (threadIdx.x == 0 && mode != "unwritten") word = float(blockIdx.x);
    if (mode == "barrier" || mode == "unwritten" || mode == "unset") __syncthreads();
    else __shfl_xor_sync(0xffffffffu, 0.0f, 1);
    if (mode != "unset" && (mode == "blocks" ? threadIdx.x == 0 : threadIdx.x == 1)) out[0] = word;
    if (mode == "past" && threadIdx.x == 31) out[1] = word;
}
} // namespace
int main(int argc, char **argv) {
    const std::string mode = argc > 1 ? argv[1] : "";
    auto out = unwritten<float>(1);
    launch({mode == "blocks" ? 2u : 1u, 1, 1}, 32, [&] { canary(mode, out.data()); });
    std::printf("%s: read %g\n", mode.c_str(), out[0]);
    return out[0] == (mode == "blocks" ? 1.0f : 0.0f) ? 0 : 1;
}
#endif
