/* The parked engine's wait, preloaded into the engine server (LD_PRELOAD).
 *
 * A parked unit (gatewayd/core/engine_units.py, "parked units") runs the engine's own
 * command line with this library preloaded and LD_BIND_NOW=1. It wraps the program's
 * main(): by the time the wrapper runs, the program is loaded, linked (every symbol
 * bound) and its static constructors have run; the wrapper then blocks on the unit's
 * FIFO. The gateway's wake writes one line (the CUDA_VISIBLE_DEVICES placement chose, or
 * "-": keep the unit's own) and the program's main() starts at once. What a shell in
 * front of the engine paid after the wake (exec, the dynamic linker, the constructors,
 * far more for a CUDA build's libraries than for a CPU llama-server) is paid while
 * parked (docs/benchmarks.md, "Figures behind choices in the code").
 *
 * Only the engine waits: the unit's environment reaches its other commands too (the
 * ExecStartPre that clears a stale socket), so the wait is for the program whose argv[0]
 * is PROGRAM_ENV's value.
 *
 * While it waits, the process is named PARKED_COMM (the gateway tells a parked unit
 * from a woken one by it); its own name comes back before main() runs. No FIFO (a
 * restart of a woken unit: the gateway unlinks it as it wakes), not a FIFO, or the
 * writer gone without a line: main() runs at once, as the shell did.
 *
 * Built as gatewayd/_engine_park*.so by setup.py (optional: without a C compiler the
 * gateway parks behind /bin/sh instead). glibc only: the gateway preloads it only into
 * programs whose interpreter is glibc's dynamic linker.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#define FIFO_ENV "LLM_GATEWAY_PARK_FIFO"
#define PROGRAM_ENV "LLM_GATEWAY_PARK_PROGRAM"
#define DEVICES_ENV "CUDA_VISIBLE_DEVICES"
#define KEEP_DEVICES "-"
#define PARKED_COMM "llm-parked"

typedef int (*main_fn)(int, char **, char **);
typedef int (*start_fn)(main_fn, int, char **, void (*)(void), void (*)(void),
                        void (*)(void), void *);

static main_fn real_main;

static void wait_for_wake(const char *fifo) {
    struct stat st;
    if (stat(fifo, &st) != 0 || !S_ISFIFO(st.st_mode))
        return;
    char comm[17] = {0};
    prctl(PR_GET_NAME, comm, 0, 0, 0);
    prctl(PR_SET_NAME, PARKED_COMM, 0, 0, 0);
    int fd;
    do
        fd = open(fifo, O_RDONLY | O_CLOEXEC);   /* blocks until the wake opens it */
    while (fd < 0 && errno == EINTR);
    if (fd >= 0) {
        char line[4096];
        size_t got = 0;
        while (got < sizeof line - 1) {
            ssize_t n = read(fd, line + got, sizeof line - 1 - got);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                break;
            got += (size_t)n;
            if (memchr(line, '\n', got) != NULL)
                break;
        }
        close(fd);
        line[got] = '\0';
        char *end = memchr(line, '\n', got);
        if (end != NULL) {   /* a whole line: the devices, or keep the unit's own */
            *end = '\0';
            if (strcmp(line, KEEP_DEVICES) != 0)
                setenv(DEVICES_ENV, line, 1);
        }
    }
    prctl(PR_SET_NAME, comm, 0, 0, 0);
}

static int parked_main(int argc, char **argv, char **envp) {
    (void)envp;   /* main() is given environ as changed here */
    const char *fifo = getenv(FIFO_ENV);
    const char *program = getenv(PROGRAM_ENV);
    if (fifo != NULL && *fifo != '\0' && program != NULL && argc > 0
            && strcmp(argv[0], program) == 0)
        wait_for_wake(fifo);
    /* the engine's children (if any) start plain */
    unsetenv(FIFO_ENV);
    unsetenv(PROGRAM_ENV);
    unsetenv("LD_PRELOAD");
    unsetenv("LD_BIND_NOW");
    return real_main(argc, argv, environ);
}

int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void),
                      void (*fini)(void), void (*rtld_fini)(void), void *stack_end) {
    start_fn real_start = (start_fn)dlsym(RTLD_NEXT, "__libc_start_main");
    if (real_start == NULL)
        _exit(127);
    real_main = main;
    return real_start(parked_main, argc, argv, init, fini, rtld_fini, stack_end);
}
