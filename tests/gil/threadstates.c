/* LD_PRELOAD shim for tests/test_dist.py: logs the native stack of every Python thread state that a
 * thread other than the main one creates through PyThreadState_New (what pybind11's
 * gil_scoped_acquire calls on a thread Python never saw, such as a gloo worker thread). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

static int log_fd = -1;

void *PyThreadState_New(void *interp) {
    static void *(*real)(void *);
    if (!real) real = (void *(*)(void *))dlsym(RTLD_NEXT, "PyThreadState_New");
    if (syscall(SYS_gettid) != getpid()) {
        if (log_fd < 0) {
            const char *path = getenv("THREADSTATES_LOG");
            char name[512];
            snprintf(name, sizeof name, "%s.%d", path ? path : "/tmp/threadstates", getpid());
            log_fd = open(name, O_WRONLY | O_CREAT | O_APPEND, 0644);
        }
        if (log_fd >= 0) {
            void *frames[32];
            int n = backtrace(frames, 32);
            (void)!write(log_fd, "=== thread state\n", 17);
            backtrace_symbols_fd(frames, n, log_fd);
        }
    }
    return real(interp);
}
