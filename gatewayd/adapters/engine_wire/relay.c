/* gatewayd.adapters.engine_wire._relay: a stream's events from the engine's socket to the client's, with no
 * interpreter per event.
 *
 * Relayed in Python, an event costs the gateway more CPU than a raw asyncio protocol that
 * passes bytes on unparsed, and that one more than llama.cpp's router (bench/hotpath.py
 * --raw; docs/benchmarks.md, "Figures behind choices in the code"): the system calls are
 * the same, the rest is the interpreter waking per event with cold caches, and on a
 * machine where the engine and the gateway share the cores it is taken from the engine.
 *
 * forward(engine_fd, client_fd, cancel_fd, read_timeout_s, stall_timeout_s) runs in a
 * thread of its own with the GIL released, on duplicates of the two connections' sockets
 * (the caller paused the engine connection's reading and writes nothing to the client
 * meanwhile). It passes on every whole chunk of the engine's chunked body that is plainly
 * one or more complete events (lowercase hex size, no extension, data ending in a blank
 * line) with its framing as it came: the client's answer is chunked the same way, as
 * http/proxy's relay_pushed sends it. It stops, handing back what it read and did not
 * pass on, at the first chunk that needs Python: one that names "usage" (the record's
 * token counts, the usage event to drop), the last chunk (size 0), anything unusual in
 * the framing (Python's parser says what is wrong), a chunk larger than its buffer. It
 * stops too when the engine closes or fails, when nothing came for read_timeout_s, when
 * the client takes nothing for stall_timeout_s or is gone, or when cancel_fd becomes
 * readable (the client's handler was cancelled, the gateway stops: the caller calls
 * interrupt(), which also wakes a read waiting on the engine).
 *
 * It waits for the engine in a blocking read (the socket made blocking, SO_RCVTIMEO the
 * read timeout, both put back before it returns): a system call and a wait queue less per
 * event than poll before each read, a measurable share of the gateway's CPU per stream
 * (bench/hotpath.py --stream, interleaved; the same table). interrupt() wakes that read
 * with shutdown(SHUT_RD), which ends the engine connection: a cancelled stream never
 * reads from it again. Where the descriptor takes no socket options, it polls before
 * reads.
 *
 * Returns (reason, errno, bytes read and not passed on, events passed on, last chunk
 * passed on, data bytes passed on, seconds since the engine's last byte, the rest of a
 * chunk whose sending a cancel interrupted: the caller sends it first).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define BUF_SIZE (64 * 1024)
#define MAX_SIZE_DIGITS 7          /* < 256 MiB: a chunk anywhere near it goes to Python */

enum { HANDBACK, ENGINE_EOF, ENGINE_ERROR, IDLE, CLIENT_GONE, STALLED, CANCELLED };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* poll's timeout in ms until deadline, rounded up (never early), capped */
static int ms_until(double deadline)
{
    double left = deadline - now_s();
    if (left <= 0)
        return 0;
    if (left > 86400.0)
        return 86400 * 1000;
    return (int)(left * 1000.0) + 1;
}

struct scanned {
    size_t ready;        /* bytes at the buffer's start to pass on: whole chunks */
    size_t last_start;   /* where the last of them starts */
    size_t data_bytes;   /* their data, framing not counted */
    long events;         /* "data: {" in them: content events (as SseRelay counts) */
    int stop;            /* the chunk after them must go to Python */
};

static struct scanned scan(const char *buf, size_t len)
{
    struct scanned s = {0, 0, 0, 0, 0};
    size_t pos = 0;
    while (pos < len) {
        const char *p = buf + pos;
        size_t avail = len - pos, i = 0, size = 0;
        for (; i < avail && i <= MAX_SIZE_DIGITS; i++) {
            char c = p[i];
            if (c >= '0' && c <= '9')
                size = size * 16 + (size_t)(c - '0');
            else if (c >= 'a' && c <= 'f')
                size = size * 16 + (size_t)(c - 'a' + 10);
            else
                break;
        }
        if (i > MAX_SIZE_DIGITS || (i > 0 && p[0] == '0')) {
            s.stop = 1;    /* too large, a leading zero, or the last chunk ("0") */
            break;
        }
        if (i == avail)
            break;         /* its size line is still coming */
        if (i == 0 || p[i] != '\r') {
            s.stop = 1;    /* an extension, uppercase hex, or bad framing */
            break;
        }
        if (i + 1 == avail)
            break;
        if (p[i + 1] != '\n') {
            s.stop = 1;
            break;
        }
        size_t head = i + 2, total = head + size + 2;
        if (total > BUF_SIZE) {
            s.stop = 1;    /* never fits the buffer */
            break;
        }
        if (avail < total)
            break;         /* the rest of the chunk is still coming */
        const char *data = p + head;
        if (data[size] != '\r' || data[size + 1] != '\n' || size < 2
                || data[size - 2] != '\n' || data[size - 1] != '\n'
                || memmem(data, size, "\"usage\"", 7) != NULL) {
            s.stop = 1;    /* not whole events, or the record needs it */
            break;
        }
        for (const char *q = data; (q = memmem(q, (size_t)(data + size - q), "data: {", 7));
             q += 7)
            s.events++;
        s.data_bytes += size;
        s.last_start = pos;
        pos += total;
        s.ready = pos;
    }
    return s;
}

static int set_read_timeout(int fd, double seconds)
{
    struct timeval tv;
    tv.tv_sec = (time_t)seconds;
    tv.tv_usec = (suseconds_t)((seconds - (double)tv.tv_sec) * 1e6);
    if (tv.tv_sec == 0 && tv.tv_usec == 0)
        tv.tv_usec = 1;    /* (0 would be no timeout at all) */
    return setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

static int cancel_signalled(int cancel)
{
    struct pollfd fd = {cancel, POLLIN, 0};
    return poll(&fd, 1, 0) > 0;
}

/* All of p to the client: 0, or why not. The client may take nothing for stall_timeout
 * (measured from the last byte it took). *left (the caller sets it to n): what is not sent. */
static int send_all(int fd, int cancel, const char *p, size_t n, double stall_timeout,
                    int *err, size_t *left)
{
    double deadline = 0;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            *left = n;
            deadline = 0;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            return CLIENT_GONE;
        }
        if (deadline == 0)
            deadline = now_s() + stall_timeout;
        struct pollfd fds[2] = {{fd, POLLOUT, 0}, {cancel, POLLIN, 0}};
        int r = poll(fds, 2, ms_until(deadline));
        if (r < 0 && errno != EINTR) {
            *err = errno;
            return CLIENT_GONE;
        }
        if (r > 0 && fds[1].revents)
            return CANCELLED;
        if (r == 0 && now_s() >= deadline)
            return STALLED;
        /* writable, or POLLERR/POLLHUP: the next send says which */
    }
    return 0;
}

static PyObject *forward(PyObject *self, PyObject *args)
{
    int engine, client, cancel;
    double read_timeout, stall_timeout;
    (void)self;
    if (!PyArg_ParseTuple(args, "iiidd:forward", &engine, &client, &cancel, &read_timeout,
                          &stall_timeout))
        return NULL;
    char *buf = PyMem_RawMalloc(BUF_SIZE), *last = PyMem_RawMalloc(BUF_SIZE);
    if (buf == NULL || last == NULL) {
        PyMem_RawFree(buf);
        PyMem_RawFree(last);
        return PyErr_NoMemory();
    }
    size_t len = 0, last_len = 0, data_bytes = 0, unsent_at = 0, unsent_len = 0;
    long events = 0;
    int reason = HANDBACK, err = 0;
    double last_read = 0, idle = 0;

    Py_BEGIN_ALLOW_THREADS
    last_read = now_s();
    struct timeval kept_timeout;
    socklen_t kept_len = sizeof kept_timeout;
    int flags = fcntl(engine, F_GETFL), blocking = 0;
    if (flags != -1 && read_timeout > 0
            && getsockopt(engine, SOL_SOCKET, SO_RCVTIMEO, &kept_timeout, &kept_len) == 0
            && set_read_timeout(engine, read_timeout) == 0) {
        blocking = fcntl(engine, F_SETFL, flags & ~O_NONBLOCK) == 0;
        if (!blocking)
            setsockopt(engine, SOL_SOCKET, SO_RCVTIMEO, &kept_timeout, kept_len);
    }
    for (;;) {
        if (!blocking) {
            struct pollfd fds[2] = {{engine, POLLIN, 0}, {cancel, POLLIN, 0}};
            int n = poll(fds, 2, ms_until(last_read + read_timeout));
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                reason = ENGINE_ERROR;
                err = errno;
                break;
            }
            if (n > 0 && fds[1].revents) {
                reason = CANCELLED;
                break;
            }
            if (n == 0) {
                if (now_s() >= last_read + read_timeout) {
                    reason = IDLE;
                    break;
                }
                continue;
            }
        }
        ssize_t got = read(engine, buf + len, BUF_SIZE - len);
        if (got < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) {
                if (!blocking)
                    continue;
                /* SO_RCVTIMEO counts from each read's start: after a signal, or a timer
                 * that ended a little early, only the rest of read_timeout is waited */
                double left = last_read + read_timeout - now_s();
                if (left <= 0) {
                    reason = IDLE;
                    break;
                }
                set_read_timeout(engine, left);
                continue;
            }
            reason = ENGINE_ERROR;
            err = errno;
            break;
        }
        if (got == 0) {
            /* the engine closed, or interrupt() shut the reading down */
            reason = blocking && cancel_signalled(cancel) ? CANCELLED : ENGINE_EOF;
            break;
        }
        len += (size_t)got;
        struct scanned s = scan(buf, len);
        if (s.ready) {
            size_t left = s.ready;
            int sent = send_all(client, cancel, buf, s.ready, stall_timeout, &err, &left);
            if (sent == CANCELLED && left < s.ready) {
                /* cancelled in the middle of a chunk: the rest goes back, for Python to
                 * send before anything else (an error event must not land inside it) */
                unsent_at = s.ready - left;
                unsent_len = left;
            } else if (sent != 0) {
                reason = sent;   /* what this send held is not counted: not all of it went */
                break;
            }
            events += s.events;
            data_bytes += s.data_bytes;
            last_len = s.ready - s.last_start;
            memcpy(last, buf + s.last_start, last_len);
            if (sent == CANCELLED) {
                reason = CANCELLED;   /* (buf stays as it is: unsent and unread are in it) */
                break;
            }
            len -= s.ready;
            memmove(buf, buf + s.ready, len);
        }
        last_read = now_s();   /* (time waiting for a slow client is not the engine's) */
        if (s.stop || len == BUF_SIZE) {
            reason = HANDBACK;
            break;
        }
    }
    idle = now_s() - last_read;
    if (blocking) {
        fcntl(engine, F_SETFL, flags);
        setsockopt(engine, SOL_SOCKET, SO_RCVTIMEO, &kept_timeout, kept_len);
    }
    Py_END_ALLOW_THREADS

    size_t unread_at = unsent_len ? unsent_at + unsent_len : 0;
    PyObject *result = Py_BuildValue(
        "(iiy#ly#ndy#)", reason, err, buf + unread_at, (Py_ssize_t)(len - unread_at), events,
        last, (Py_ssize_t)last_len, (Py_ssize_t)data_bytes, idle, buf + unsent_at,
        (Py_ssize_t)unsent_len);
    PyMem_RawFree(buf);
    PyMem_RawFree(last);
    return result;
}

/* Stops a forward() on these descriptors: its cancel signalled, its engine read woken. */
static PyObject *interrupt(PyObject *self, PyObject *args)
{
    int cancel, engine;
    uint64_t one = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "ii:interrupt", &cancel, &engine))
        return NULL;
    if (write(cancel, &one, sizeof one) < 0 && errno != EAGAIN)
        return PyErr_SetFromErrno(PyExc_OSError);
    shutdown(engine, SHUT_RD);   /* (ENOTCONN where the engine has gone already) */
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS,
     "forward(engine_fd, client_fd, cancel_fd, read_timeout_s, stall_timeout_s) -> "
     "(reason, errno, unread, events, last_chunk, data_bytes, idle_s, unsent)"},
    {"interrupt", interrupt, METH_VARARGS,
     "interrupt(cancel_fd, engine_fd): stops the forward() on them, at once"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gatewayd.adapters.engine_wire._relay",
    "A stream's events from the engine's socket to the client's (gatewayd/adapters/engine_wire/relay.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__relay(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "HANDBACK", HANDBACK) < 0
            || PyModule_AddIntConstant(m, "ENGINE_EOF", ENGINE_EOF) < 0
            || PyModule_AddIntConstant(m, "ENGINE_ERROR", ENGINE_ERROR) < 0
            || PyModule_AddIntConstant(m, "IDLE", IDLE) < 0
            || PyModule_AddIntConstant(m, "CLIENT_GONE", CLIENT_GONE) < 0
            || PyModule_AddIntConstant(m, "STALLED", STALLED) < 0
            || PyModule_AddIntConstant(m, "CANCELLED", CANCELLED) < 0
            || PyModule_AddIntConstant(m, "BUF_SIZE", BUF_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
