/* In-sandbox launcher, in C: the same program as _forwarder.py, without Python's start-up.

       hrl-forwarder PORT UNIX_SOCKET [--status-fd FD] [--rlimit NAME=N]... -- CMD [ARG...]

   Relays 127.0.0.1:PORT (and [::1]:PORT when the namespace has IPv6) to the proxy's unix
   socket while CMD runs, then exits with CMD's status (128+N for a signal) after writing
   "exit N cpu S" / "signal N cpu S" to FD (S: CPU seconds, user + system, of CMD and of the
   processes it waited for). ``--rlimit`` sets a limit (soft = hard) before anything else,
   in place of a ``prlimit`` exec before it. See _forwarder.py for the why; the two behave the same and
   tests/test_sandbox_bwrap.py runs its forwarder tests against both. Built once per host by
   actors/sandbox/bwrap.py (`cc -O2`); where no C compiler works the Python one is used.

   One thread, epoll, non-blocking sockets, half-close relayed; no dependencies beyond libc. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <unistd.h>

#define BUF (256 * 1024)
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

enum { K_LISTEN = 1, K_CHILD = 2, K_SIDE = 3 };

struct relay;
struct side {
    int kind; /* K_SIDE; must come first (epoll data points here) */
    struct relay *r;
    int i;
};
struct relay {
    int fd[2];
    char *buf[2]; /* buf[i]: bytes read from fd[i], not yet written to fd[1-i] */
    size_t len[2];
    int eof[2], shut[2];
    unsigned mask[2];
    struct side side[2];
    int closed;
};
struct tagged {
    int kind;
    int fd;
};

static int ep;
static const char *unix_path;
static int warned;

static void set_mask(struct relay *r, int i, unsigned m) {
    if (m == r->mask[i]) return;
    struct epoll_event ev = {.events = m, .data.ptr = &r->side[i]};
    int op = r->mask[i] == 0 ? EPOLL_CTL_ADD : m == 0 ? EPOLL_CTL_DEL : EPOLL_CTL_MOD;
    epoll_ctl(ep, op, r->fd[i], &ev);
    r->mask[i] = m;
}

static void relay_close(struct relay *r) {
    r->closed = 1;
    for (int i = 0; i < 2; i++) {
        set_mask(r, i, 0);
        close(r->fd[i]);
        free(r->buf[i]);
    }
    /* freed after the current batch of events (see main): other events may point here */
}

static void relay_update(struct relay *r) {
    if (r->closed) return;
    for (int i = 0; i < 2; i++) {
        int src = 1 - i;
        if (r->eof[src] && !r->len[src] && !r->shut[i]) {
            r->shut[i] = 1;
            shutdown(r->fd[i], SHUT_WR);
        }
    }
    if (r->shut[0] && r->shut[1]) {
        relay_close(r);
        return;
    }
    for (int i = 0; i < 2; i++) {
        unsigned m = 0;
        if (!r->eof[i] && r->len[i] < BUF) m |= EPOLLIN;
        if (r->len[1 - i]) m |= EPOLLOUT;
        set_mask(r, i, m);
    }
}

static void relay_event(struct relay *r, int i, unsigned ev) {
    if (r->closed) return;
    /* a hang-up or error reads as every registered event, as in the Python one */
    int rd = (ev & EPOLLIN) || (ev & ~(unsigned)EPOLLOUT & ~(unsigned)EPOLLIN);
    int wr = (ev & EPOLLOUT) || (ev & ~(unsigned)EPOLLOUT & ~(unsigned)EPOLLIN);
    rd = rd && (r->mask[i] & EPOLLIN);
    wr = wr && (r->mask[i] & EPOLLOUT);
    if (rd) {
        ssize_t n = recv(r->fd[i], r->buf[i] + r->len[i], BUF - r->len[i], 0);
        if (n > 0)
            r->len[i] += (size_t)n;
        else if (n == 0)
            r->eof[i] = 1;
        else if (errno != EAGAIN && errno != EINTR) {
            relay_close(r);
            return;
        }
    }
    if (wr) {
        int o = 1 - i;
        ssize_t n = send(r->fd[i], r->buf[o], r->len[o], MSG_NOSIGNAL);
        if (n > 0) {
            memmove(r->buf[o], r->buf[o] + n, r->len[o] - (size_t)n);
            r->len[o] -= (size_t)n;
        } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
            relay_close(r);
            return;
        }
    }
    relay_update(r);
}

static void relay_new(int c, int u) {
    struct relay *r = calloc(1, sizeof *r);
    if (r) {
        r->buf[0] = malloc(BUF);
        r->buf[1] = malloc(BUF);
    }
    if (!r || !r->buf[0] || !r->buf[1]) {
        if (r) {
            free(r->buf[0]);
            free(r->buf[1]);
        }
        free(r);
        close(c);
        close(u);
        return;
    }
    r->fd[0] = c;
    r->fd[1] = u;
    for (int i = 0; i < 2; i++) r->side[i] = (struct side){K_SIDE, r, i};
    relay_update(r);
}

static void do_accept(int lfd) {
    for (;;) {
        int c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) return;
        int u = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        strncpy(a.sun_path, unix_path, sizeof a.sun_path - 1);
        struct timeval tv = {5, 0};
        if (u >= 0) setsockopt(u, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (u < 0 || connect(u, (struct sockaddr *)&a, sizeof a) < 0) {
            int e = errno;
            if (u >= 0) close(u);
            close(c);
            if (!warned) {
                warned = 1;
                fprintf(stderr, "hrl-forwarder: proxy socket unavailable: %s\n", strerror(e));
            }
            continue;
        }
        int one = 1;
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fcntl(u, F_SETFL, fcntl(u, F_GETFL) | O_NONBLOCK);
        relay_new(c, u);
    }
}

static int listen_on(int family, int port) {
    int s = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    int one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (family == AF_INET) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        rc = bind(s, (struct sockaddr *)&a, sizeof a);
    } else {
        setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port)};
        a.sin6_addr = in6addr_loopback;
        rc = bind(s, (struct sockaddr *)&a, sizeof a);
    }
    if (rc < 0 || listen(s, 256) < 0) {
        int e = errno;
        close(s);
        errno = e;
        return -1;
    }
    return s;
}

static void report(int fd, int status, const struct rusage *ru) {
    if (fd < 0) return;
    char line[64];
    double cpu = (double)ru->ru_utime.tv_sec + (double)ru->ru_utime.tv_usec / 1e6 +
                 (double)ru->ru_stime.tv_sec + (double)ru->ru_stime.tv_usec / 1e6;
    int n = WIFSIGNALED(status)
                ? snprintf(line, sizeof line, "signal %d cpu %.3f\n", WTERMSIG(status), cpu)
                : snprintf(line, sizeof line, "exit %d cpu %.3f\n", WEXITSTATUS(status), cpu);
    if (write(fd, line, (size_t)n) < 0) { /* best effort */
    }
    close(fd);
}

/* "NAME=N": soft and hard limit N for nproc, data, fsize, nofile or core */
static int set_rlimit(const char *spec) {
    static const struct {
        const char *name;
        int res;
    } names[] = {{"nproc", RLIMIT_NPROC}, {"data", RLIMIT_DATA}, {"fsize", RLIMIT_FSIZE},
                 {"nofile", RLIMIT_NOFILE}, {"core", RLIMIT_CORE}};
    const char *eq = strchr(spec, '=');
    char *end;
    errno = EINVAL;
    if (!eq || !eq[1]) return -1;
    unsigned long long v = strtoull(eq + 1, &end, 10);
    if (*end) return -1;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        if (strlen(names[i].name) == (size_t)(eq - spec) &&
            strncmp(names[i].name, spec, (size_t)(eq - spec)) == 0) {
            struct rlimit rl = {(rlim_t)v, (rlim_t)v};
            return setrlimit(names[i].res, &rl);
        }
    }
    return -1;
}

int main(int argc, char **argv) {
    int status_fd = -1;
    char **a = argv + 1;
    int n = argc - 1;
    if (n >= 4 && strcmp(a[2], "--status-fd") == 0) {
        status_fd = atoi(a[3]);
        fcntl(status_fd, F_SETFD, FD_CLOEXEC); /* the command must not be able to write it */
        memmove(a + 2, a + 4, (size_t)(n - 4 + 1) * sizeof *a);
        n -= 2;
    }
    while (n >= 4 && strcmp(a[2], "--rlimit") == 0) { /* prlimit's job, one exec less */
        if (set_rlimit(a[3]) < 0) {
            fprintf(stderr, "hrl-forwarder: cannot set rlimit %s: %s\n", a[3], strerror(errno));
            return 125;
        }
        memmove(a + 2, a + 4, (size_t)(n - 4 + 1) * sizeof *a);
        n -= 2;
    }
    if (n < 4 || strcmp(a[2], "--") != 0) {
        fprintf(stderr, "usage: hrl-forwarder PORT UNIX_SOCKET [--status-fd FD] "
                        "[--rlimit NAME=N]... -- CMD [ARG...]\n");
        return 125;
    }
    int port = atoi(a[0]);
    unix_path = a[1];
    char **cmd = a + 3;
    signal(SIGPIPE, SIG_IGN);
    ep = epoll_create1(EPOLL_CLOEXEC);
    struct tagged lst[2];
    int nl = 0;
    int fams[2] = {AF_INET, AF_INET6};
    for (int k = 0; k < 2; k++) {
        int s = listen_on(fams[k], port);
        if (s < 0) {
            if (fams[k] == AF_INET) {
                fprintf(stderr, "hrl-forwarder: cannot listen on 127.0.0.1:%d: %s\n", port,
                        strerror(errno));
                return 125;
            }
            continue;
        }
        lst[nl] = (struct tagged){K_LISTEN, s};
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &lst[nl]};
        epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
        nl++;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "hrl-forwarder: cannot fork: %s\n", strerror(errno));
        return 125;
    }
    if (pid == 0) {
        signal(SIGPIPE, SIG_DFL); /* a harness gets the default actions */
        execvp(cmd[0], cmd);
        int e = errno;
        fprintf(stderr, "hrl-forwarder: cannot execute %s: %s\n", cmd[0], strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    struct tagged child = {K_CHILD, (int)syscall(SYS_pidfd_open, pid, 0)};
    if (child.fd >= 0) {
        fcntl(child.fd, F_SETFD, FD_CLOEXEC);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &child};
        epoll_ctl(ep, EPOLL_CTL_ADD, child.fd, &ev);
    }
    struct epoll_event evs[64];
    struct relay *dead[128];
    for (;;) {
        int k = epoll_wait(ep, evs, 64, child.fd >= 0 ? -1 : 50);
        int nd = 0;
        for (int j = 0; j < k; j++) {
            int kind = *(int *)evs[j].data.ptr;
            if (kind == K_LISTEN) {
                do_accept(((struct tagged *)evs[j].data.ptr)->fd);
            } else if (kind == K_SIDE) {
                struct side *s = evs[j].data.ptr;
                int was = s->r->closed;
                relay_event(s->r, s->i, evs[j].events);
                if (!was && s->r->closed && nd < 128) dead[nd++] = s->r;
            }
        }
        for (int j = 0; j < nd; j++) free(dead[j]);
        int st;
        struct rusage ru;
        pid_t w = wait4(pid, &st, WNOHANG, &ru);
        if (w == pid) {
            report(status_fd, st, &ru);
            return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st);
        }
    }
}
