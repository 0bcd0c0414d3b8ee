/* LD_PRELOAD shim for tests/test_dist.py: logs the native stack of every Python thread state that a
 * thread other than the main one creates through PyThreadState_New (what pybind11's
 * gil_scoped_acquire calls on a thread Python never saw, such as a gloo worker thread).
 * With THREADSTATES_DELAY_MS set, it also logs "begin TID NS" and "end TID NS" (CLOCK_MONOTONIC, as
 * Python's time.monotonic_ns) around the creation and waits that long before it: a thread held up
 * on its way to the runtime's HEAD_LOCK, where a fork at that moment deadlocks CPython < 3.11.10. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int log_fd = -1;

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void mark(const char *what) {
    char line[96];
    int n = snprintf(line, sizeof line, "%s %ld %lld\n", what, (long)syscall(SYS_gettid), now_ns());
    (void)!write(log_fd, line, n);
}

void *PyThreadState_New(void *interp) {
    static void *(*real)(void *);
    if (!real) real = (void *(*)(void *))dlsym(RTLD_NEXT, "PyThreadState_New");
    if (syscall(SYS_gettid) == getpid()) return real(interp);
    if (log_fd < 0) {
        const char *path = getenv("THREADSTATES_LOG");
        char name[512];
        snprintf(name, sizeof name, "%s.%d", path ? path : "/tmp/threadstates", getpid());
        log_fd = open(name, O_WRONLY | O_CREAT | O_APPEND, 0644);
    }
    if (log_fd < 0) return real(interp);
    void *frames[32];
    int n = backtrace(frames, 32);
    (void)!write(log_fd, "=== thread state\n", 17);
    backtrace_symbols_fd(frames, n, log_fd);
    const char *delay = getenv("THREADSTATES_DELAY_MS");
    if (!delay) return real(interp);
    mark("begin");
    usleep((useconds_t)atoi(delay) * 1000);
    void *made = real(interp);
    mark("end");
    return made;
}
