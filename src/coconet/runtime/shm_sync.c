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
 * growing interval up to 200 us, so that ranks outnumbering cores do not starve each other. Every
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
 * deadline). */
int cn_wait_all(uint64_t **counters, const int32_t *pids, int n, uint64_t target,
                double timeout_s, int32_t *why, uint64_t **aborts) {
    double start = now_s(), last_check = start;
    long sleep_ns = 1000;
    for (unsigned long spin = 0;; spin++) {
        int waiting = -1;
        for (int i = 0; i < n; i++) {
            if (pids[i] > 0 && __atomic_load_n(counters[i], __ATOMIC_ACQUIRE) < target) {
                waiting = i;
                break;
            }
        }
        if (waiting < 0) return -1;
        if (spin < 4096) {
            CN_PAUSE();
            continue;
        }
        if (spin < 4096 + 64) {
            sched_yield();
            continue;
        }
        double t = now_s();
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
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 200000) sleep_ns *= 2;
    }
}
