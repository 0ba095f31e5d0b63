/* Signals between the ranks of one host, over shared memory: coconet.runtime.symmem loads this
 * with ctypes (built once per build key by the system C compiler, see native.py).
 *
 * Each rank writes only its own counters (one per phase, each on its own cache line) and never
 * resets them: a counter is an epoch that only grows. A writer stores its data with ordinary
 * stores, then publishes with a release store of the counter; a reader waits with acquire loads
 * until the counter reaches the epoch it needs, then reads the data. Release/acquire makes the
 * data visible before the counter on every architecture (x86-64 TSO and aarch64 alike); the
 * function call boundary also keeps the compiler from moving the data stores across it.
 *
 * Waiting spins briefly (the peer is usually about to arrive), then yields, then sleeps with a
 * growing interval up to 200 us, so that ranks outnumbering cores do not starve each other (see
 * cn_wait_all for the stages and why). Every
 * wait has a deadline and checks every ~10 ms that the peers it waits for are alive (a SIGKILLed
 * peer is a zombie or gone): it never hangs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#define CN_PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CN_PAUSE() __asm__ __volatile__("yield")
#else
#define CN_PAUSE() ((void)0)
#endif

void cn_store_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

uint64_t cn_load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* 1 if process `pid` is running or stopped, 0 if it is gone or a zombie (killed, not reaped). */
int cn_alive(int32_t pid) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1; /* no procfs: kill() is all the evidence there is */
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *close_paren = strrchr(buf, ')'); /* "pid (comm) S ..." */
    if (!close_paren || close_paren[1] != ' ') return 1;
    char state = close_paren[2];
    return !(state == 'Z' || state == 'X' || state == 'x');
}

/* Wait until *counters[i] >= target for every i < n whose pids[i] > 0 (0: skip, e.g. oneself).
 * Returns -1 when all arrived; else the index of the peer it gave up on, with *why = 1 (the
 * deadline passed), 2 (that peer died) or 3 (that peer aborted: its *aborts[i] is non-zero, set
 * when its step failed or was interrupted, so that the waiters learn at once and not at the
 * deadline).
 *
 * How it waits, in three stages by the time waited so far:
 * - up to spin_s: busy-polls with a pause between looks: a peer that is about to post (the usual
 *   case for a small collective) is seen within ~100 ns;
 * - up to yield_s: polls with sched_yield() between looks: still no wake-up latency, but a rank
 *   that shares its core with a peer (more ranks than cores, or other jobs) hands the core over
 *   at every look instead of starving the rank it waits for;
 * - after that: sleeps with a doubling interval up to 200 us (a peer that is busy for long, a
 *   slow compile, a stalled peer): a sleeping waiter costs ~60-100 us per wake-up, which is why
 *   the first two stages exist.
 * The aborts, the waited-for peer's life and the deadline are looked at every ~10 ms in every
 * stage, so no stage can hang. */
int cn_wait_all(uint64_t **counters, const int32_t *pids, int n, uint64_t target,
                double timeout_s, int32_t *why, uint64_t **aborts, double spin_s,
                double yield_s) {
    double start = 0.0, last_check = 0.0;
    long sleep_ns = 1000;
    for (unsigned long look = 0;; look++) {
        int waiting = -1;
        for (int i = 0; i < n; i++) {
            if (pids[i] > 0 && __atomic_load_n(counters[i], __ATOMIC_ACQUIRE) < target) {
                waiting = i;
                break;
            }
        }
        if (waiting < 0) return -1;
        double t = now_s();
        if (look == 0) start = last_check = t; /* the clock only once it is needed */
        if (t - last_check > 0.01) {
            last_check = t;
            for (int i = 0; i < n; i++) {
                if (pids[i] > 0 && __atomic_load_n(aborts[i], __ATOMIC_ACQUIRE) != 0) {
                    *why = 3;
                    return i;
                }
            }
            if (!cn_alive(pids[waiting])) {
                *why = 2;
                return waiting;
            }
            if (t - start > timeout_s) {
                *why = 1;
                return waiting;
            }
        }
        double waited = t - start;
        if (waited < spin_s) {
            for (int k = 0; k < 8; k++) CN_PAUSE();
            continue;
        }
        if (waited < yield_s) {
            sched_yield();
            continue;
        }
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 200000) sleep_ns *= 2;
    }
}

/* A small all_reduce in one round of signals (coconet.runtime.shmem's one-shot form), in one call:
 * the Python around it cost more than the signals and the arithmetic.
 *
 * inputs[r]: rank r's copy of the input (count elements), for every rank of the group; src: this
 * rank's data, copied into inputs[me] once this rank's CONSUMED counters of the previous epoch
 * show that every peer is done reading it (NULL: inputs[me] already holds it, a registered
 * tensor); out: where the reduction goes. With `previous`, first waits until every peer posted
 * CONSUMED for epoch - 1 (the shared-memory transport's begin: this rank's areas are free). With `registered`, inputs[me] is memory the peers read
 * and may be the caller's own tensor: the result is reduced into `out` (a scratch area) and
 * copied into `dst` only after every peer posted CONSUMED for this epoch (dst may be NULL: no
 * copy, but the wait still happens so that the caller may overwrite inputs[me] at once).
 *
 * The reduction is elementwise in rank order, ((x0 . x1) . x2) ..., each step one IEEE operation
 * on two operands (no reassociation, no contraction: this file is built without -ffast-math),
 * so the result is bitwise what torch's rank-order reduction and coconet's simulator compute.
 * dtype: 0 float32, 1 float64, 2 int32, 3 int64 (integers wrap, as torch's do); op: 0 SUM,
 * 1 PROD, 2 MAX, 3 MIN (MAX and MIN only for integers: NaN rules differ between libraries, so
 * the float ones stay with torch).
 *
 * counters: ready[r], consumed[r] point at rank r's READY and CONSUMED counters; pids[me] must be
 * 0 (oneself is never waited for). Returns -1, or the peer given up on with a->why as for
 * cn_wait_all (4: no such reduction) and a->stage = 0 (the previous epoch's CONSUMED), 1 (READY),
 * 2 (CONSUMED). */
#define CN_REDUCE(T, OPX)                                                                      \
    do {                                                                                       \
        T *o = (T *)out;                                                                       \
        const T *a = (const T *)inputs[0], *b = (const T *)inputs[1];                          \
        for (int64_t k = 0; k < count; k++) { T x = a[k], y = b[k]; o[k] = OPX; }              \
        for (int r = 2; r < n; r++) {                                                          \
            b = (const T *)inputs[r];                                                          \
            for (int64_t k = 0; k < count; k++) { T x = o[k], y = b[k]; o[k] = OPX; }          \
        }                                                                                      \
    } while (0)

/* One body, compiled once per vector width (CN_REDUCE_AT); each loop is one IEEE operation per
 * element on two operands, so every width computes the same bits (a wider vector does more
 * elements per instruction, never a different sum). */
#define CN_REDUCE_BODY                                                                         \
    switch (dtype * 4 + op) {                                                                  \
    case 0: CN_REDUCE(float, x + y); return 0;                                                 \
    case 1: CN_REDUCE(float, x * y); return 0;                                                 \
    case 4: CN_REDUCE(double, x + y); return 0;                                                \
    case 5: CN_REDUCE(double, x * y); return 0;                                                \
    case 8: CN_REDUCE(uint32_t, x + y); return 0;                                              \
    case 9: CN_REDUCE(uint32_t, x * y); return 0;                                              \
    case 10: CN_REDUCE(int32_t, x > y ? x : y); return 0;                                      \
    case 11: CN_REDUCE(int32_t, x < y ? x : y); return 0;                                      \
    case 12: CN_REDUCE(uint64_t, x + y); return 0;                                             \
    case 13: CN_REDUCE(uint64_t, x * y); return 0;                                             \
    case 14: CN_REDUCE(int64_t, x > y ? x : y); return 0;                                      \
    case 15: CN_REDUCE(int64_t, x < y ? x : y); return 0;                                      \
    default: return -1;                                                                        \
    }

#define CN_REDUCE_AT(name, attributes)                                                         \
    __attribute__(attributes) static int name(void **inputs, void *out, int64_t count,         \
                                              int dtype, int op, int n) {                      \
        CN_REDUCE_BODY                                                                         \
    }

/* Vector widths: 0 the architecture's baseline (SSE2 on x86-64, NEON on aarch64), 1 AVX2,
 * 2 AVX-512. The library is built without -march (it must load on any CPU of the
 * architecture), so the wider bodies are compiled with target attributes and picked at run time:
 * the widest the CPU has, capped by cn_set_width (coconet.runtime.native passes the width torch's
 * own kernels use, so ATEN_CPU_CAPABILITY governs this arithmetic as it governs torch's). */
CN_REDUCE_AT(reduce_base, (optimize("O3")))
#if defined(__x86_64__) && defined(__GNUC__)
CN_REDUCE_AT(reduce_avx2, (optimize("O3"), target("avx2")))
CN_REDUCE_AT(reduce_avx512, (optimize("O3"), target("avx512f,prefer-vector-width=512")))
#define CN_MAX_WIDTH 2
static int cn_cpu_width(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2")) return 1;
    return 0;
}
#else
#define CN_MAX_WIDTH 0
static int cn_cpu_width(void) { return 0; }
#endif

typedef int (*cn_reduce_fn)(void **, void *, int64_t, int, int, int);
static int cn_width = -1; /* -1: not chosen yet (the widest the CPU has, at first use) */

static cn_reduce_fn reduce_at(int width) {
#if CN_MAX_WIDTH >= 2
    if (width >= 2) return reduce_avx512;
    if (width == 1) return reduce_avx2;
#endif
    (void)width;
    return reduce_base;
}

/* Cap the vector width of every later reduction at `width` (clamped to what this CPU has;
 * negative: the widest it has). Returns the width now in use. */
int cn_set_width(int width) {
    int most = cn_cpu_width();
    cn_width = (width < 0 || width > most) ? most : width;
    return cn_width;
}

/* The rank-order reduction of n inputs into `out` at vector width `width` (clamped as
 * cn_set_width clamps it; negative: the width in use): what cn_one_shot computes, callable alone
 * so that every width can be checked against the others bit for bit. Returns the width used, or
 * -1 for a dtype/op code without a reduction. */
int cn_reduce(void **inputs, void *out, int64_t count, int dtype, int op, int n, int width) {
    int most = cn_cpu_width();
    if (width < 0) width = cn_width < 0 ? most : cn_width;
    if (width > most) width = most;
    if (n == 1) {
        size_t bytes = (dtype == 1 || dtype == 3) ? 8 : 4;
        if (out != inputs[0]) memcpy(out, inputs[0], (size_t)count * bytes);
        return (dtype >= 0 && dtype < 4 && op >= 0 && op < 4) ? width : -1;
    }
    return reduce_at(width)(inputs, out, count, dtype, op, n) == 0 ? width : -1;
}

static int reduce_into(void **inputs, void *out, int64_t count, int dtype, int op, int n) {
    if (cn_width < 0) cn_set_width(-1);
    return cn_reduce(inputs, out, count, dtype, op, n, cn_width) < 0 ? -1 : 0;
}

/* What one kind of call (a group, a dtype, a size, a reduction, where the inputs live) always
 * passes: made once per kind by the caller, so that a call converts 6 arguments and not 21
 * (ctypes spends ~0.15 us on each). */
typedef struct {
    void **inputs;
    int64_t count;
    int32_t dtype, op, n, me, registered;
    uint64_t **ready, **consumed;
    const int32_t *pids;
    uint64_t **aborts;
    double timeout_s, spin_s, yield_s;
    int32_t why, stage; /* out: why and where a call gave up */
    /* Control words (0 words: none): heads[r] points at rank r's words, ahead of its input.
     * A call with words writes this rank's into heads[me] before posting READY and, once every
     * peer has posted READY, copies every rank's words into `hout` (rank after rank) before
     * posting CONSUMED: the control channel's agreement and votes, in the same round as a payload
     * that may ride along (coconet.runtime.shmem's words_round). */
    void **heads;
    int32_t head_words;
} cn_one_shot_args;

int cn_one_shot(cn_one_shot_args *a, const void *src, void *out, void *dst, uint64_t epoch,
                int previous, const int64_t *hsrc, int64_t *hout) {
    int late, n = a->n, me = a->me;
    size_t width = (a->dtype == 1 || a->dtype == 3) ? 8 : 4;
    if (previous) { /* this rank's areas may be overwritten once every peer is done with them */
        a->stage = 0;
        late = cn_wait_all(a->consumed, a->pids, n, epoch - 1, a->timeout_s, &a->why, a->aborts,
                           a->spin_s, a->yield_s);
        if (late >= 0) return late;
    }
    if (src != NULL) memcpy(a->inputs[me], src, (size_t)a->count * width);
    size_t words = (size_t)a->head_words * sizeof(int64_t);
    if (words) memcpy(a->heads[me], hsrc, words);
    __atomic_store_n(a->ready[me], epoch, __ATOMIC_RELEASE);
    a->stage = 1;
    late = cn_wait_all(a->ready, a->pids, n, epoch, a->timeout_s, &a->why, a->aborts, a->spin_s,
                       a->yield_s);
    if (late >= 0) return late;
    if (words)
        for (int r = 0; r < n; r++) memcpy((char *)hout + (size_t)r * words, a->heads[r], words);
    if (reduce_into(a->inputs, out, a->count, a->dtype, a->op, n) != 0) {
        a->why = 4;
        return me;
    }
    __atomic_store_n(a->consumed[me], epoch, __ATOMIC_RELEASE);
    /* A peer that posted its part and then aborted before reading (its deadline passed while
     * this rank was late, or it failed meanwhile) did not finish this round: it fails here too,
     * instead of this rank alone going on past a round its peer gave up. */
    for (int r = 0; r < n; r++) {
        if (r != me && a->pids[r] > 0 && __atomic_load_n(a->aborts[r], __ATOMIC_ACQUIRE) != 0 &&
            __atomic_load_n(a->consumed[r], __ATOMIC_ACQUIRE) < epoch) {
            a->stage = 2;
            a->why = 3;
            return r;
        }
    }
    if (a->registered) {
        a->stage = 2;
        late = cn_wait_all(a->consumed, a->pids, n, epoch, a->timeout_s, &a->why, a->aborts,
                           a->spin_s, a->yield_s);
        if (late >= 0) return late;
        if (dst != NULL && dst != out) memcpy(dst, out, (size_t)a->count * width);
    }
    return -1;
}
