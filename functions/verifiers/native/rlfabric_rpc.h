/* The wire between a C program and its assert-style tests, which run in two sandboxes: the
 * C twin of rlfabric_rpc.hpp (the same frames and encoding; read its comment). C has no
 * templates, so functions/verifiers/native.py generates, per function of the program the
 * tests call, a stub for the tests (rlf_begin, rlf_put_*, rlf_call, rlf_get_*, rlf_end) and
 * a handler for the program's server (rlf_get_*, rlf_put_*), both from the declared types.
 *
 * Types: integers and bool (8 bytes), float (4), double (8), and C strings (a u8 flag, 0 a
 * null pointer, then a u64 length and the bytes). A `char *` parameter (not const) is
 * copied back after the call: exactly as many bytes as the tests' string had, so the
 * program can change its characters in place (never grow it: the tests' buffer may be no
 * larger), and only when they changed (a string literal the function did not write to
 * stays untouched). Included first in its translation unit: no macro of the program's or
 * the tests' reaches it. */
#ifndef RLFABRIC_RPC_H
#define RLFABRIC_RPC_H
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* read, write and _exit under names of the wire's own, bound to libc's symbols: <unistd.h>
 * would declare truncate, link, access... in both translation units, and a program's own
 * function of such a name would then not compile (or its stub would be refused). The
 * symbols are glibc's reserved aliases __read and __write, not read and write: a C program
 * may define its own `write` (a global symbol, which the program's binary would then call
 * for the channel), and the stub of that library name is a static pointer `write` in the
 * tests' object (which the assembler would take for a call to "write") */
extern long rlf_sys_read(int fd, void *p, size_t n) __asm__("__read");
extern long rlf_sys_write(int fd, const void *p, size_t n) __asm__("__write");
extern void rlf_sys_exit(int code) __asm__("_exit") __attribute__((noreturn));

#define RLF_PROTOCOL_ERROR 12
#define RLF_PROGRAM_GONE 13
#define RLF_MAX_FRAME (16u << 20)

typedef struct { char *b; size_t n, cap; } rlf_out;
typedef struct { const char *p; size_t n; int bad; char *frame; } rlf_in;

static void rlf_die(int code, const char *what) {
    fflush(stdout);
    fprintf(stderr, "\nrlfabric: %s\n", what);
    fflush(stderr);
    rlf_sys_exit(code);
}

static void rlf_raw(rlf_out *o, const void *p, size_t k) {
    if (o->n + k > o->cap) {
        size_t cap = o->cap ? o->cap : 256;
        while (cap < o->n + k) cap *= 2;
        char *b = (char *)realloc(o->b, cap);
        if (!b) rlf_die(RLF_PROTOCOL_ERROR, "out of memory for a frame");
        o->b = b;
        o->cap = cap;
    }
    memcpy(o->b + o->n, p, k);
    o->n += k;
}
static void rlf_take(rlf_in *i, void *dst, size_t k) {
    if (i->bad || k > i->n) {
        i->bad = 1;
        memset(dst, 0, k);
        return;
    }
    memcpy(dst, i->p, k);
    i->p += k;
    i->n -= k;
}

static void rlf_put_byte(rlf_out *o, unsigned char v) { rlf_raw(o, &v, 1); }
static void rlf_put_i(rlf_out *o, long long v) { int64_t x = v; rlf_raw(o, &x, 8); }
static void rlf_put_u(rlf_out *o, unsigned long long v) { uint64_t x = v; rlf_raw(o, &x, 8); }
static void rlf_put_f(rlf_out *o, float v) { rlf_raw(o, &v, 4); }
static void rlf_put_d(rlf_out *o, double v) { rlf_raw(o, &v, 8); }
static void rlf_put_s(rlf_out *o, const char *s) {
    rlf_put_byte(o, s != NULL);
    if (s) {
        uint64_t n = strlen(s);
        rlf_raw(o, &n, 8);
        rlf_raw(o, s, n);
    }
}
static long long rlf_get_i(rlf_in *i) { int64_t x = 0; rlf_take(i, &x, 8); return x; }
static unsigned long long rlf_get_u(rlf_in *i) { uint64_t x = 0; rlf_take(i, &x, 8); return x; }
static float rlf_get_f(rlf_in *i) { float x = 0; rlf_take(i, &x, 4); return x; }
static double rlf_get_d(rlf_in *i) { double x = 0; rlf_take(i, &x, 8); return x; }
/* a fresh malloc'd copy (the caller owns it), and its length */
static char *rlf_get_sn(rlf_in *i, size_t *len) {
    unsigned char f = 0;
    uint64_t n = 0;
    rlf_take(i, &f, 1);
    *len = 0;
    if (!f || i->bad) return NULL;
    rlf_take(i, &n, 8);
    if (i->bad || n > i->n) {
        i->bad = 1;
        return NULL;
    }
    char *s = (char *)malloc(n + 1);
    if (!s) rlf_die(RLF_PROTOCOL_ERROR, "out of memory for a string of the program");
    memcpy(s, i->p, n);
    s[n] = 0;
    i->p += n;
    i->n -= n;
    *len = n;
    return s;
}
static char *rlf_get_s(rlf_in *i) { size_t n; return rlf_get_sn(i, &n); }

static int rlf_write_all(const char *p, size_t n) {
    while (n) {
        long w = rlf_sys_write(4, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return 0;
        p += w;
        n -= (size_t)w;
    }
    return 1;
}
static int rlf_read_all(char *p, size_t n) {
    while (n) {
        long r = rlf_sys_read(3, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return 0;
        p += r;
        n -= (size_t)r;
    }
    return 1;
}
static int rlf_send(const rlf_out *o) {
    uint32_t n = (uint32_t)o->n;
    return rlf_write_all((const char *)&n, 4) && rlf_write_all(o->b, o->n);
}
/* 0: a frame in *in (its buffer malloc'd); 1: the channel ended; 2: over the frame limit */
static int rlf_recv(rlf_in *in) {
    uint32_t n = 0;
    memset(in, 0, sizeof *in);
    if (!rlf_read_all((char *)&n, 4)) return 1;
    if (n > RLF_MAX_FRAME) return 2;
    in->frame = (char *)malloc(n ? n : 1);
    if (!in->frame) rlf_die(RLF_PROTOCOL_ERROR, "out of memory for a frame");
    if (!rlf_read_all(in->frame, n)) return 1;
    in->p = in->frame;
    in->n = n;
    return 0;
}

/* -- the tests' side ------------------------------------------------------------------ */
static rlf_out rlf_begin(uint32_t fn) {
    rlf_out o = {0, 0, 0};
    rlf_raw(&o, &fn, 4);
    return o;
}
static rlf_in rlf_call(rlf_out *o, const char *name) {
    rlf_in in;
    unsigned char kind = 2;
    if (o->n > RLF_MAX_FRAME) rlf_die(RLF_PROTOCOL_ERROR, "the arguments of a call are over the 16 MiB frame limit");
    if (!rlf_send(o)) rlf_die(RLF_PROGRAM_GONE, "the program closed the channel (it exited or crashed)");
    free(o->b);
    switch (rlf_recv(&in)) {
    case 1: rlf_die(RLF_PROGRAM_GONE, "the program closed the channel (it exited or crashed)");
    case 2: rlf_die(RLF_PROTOCOL_ERROR, "the program sent a frame over the 16 MiB limit");
    }
    rlf_take(&in, &kind, 1);
    if (kind != 0) {
        fprintf(stderr, "rlfabric: in a call of %s\n", name);
        rlf_die(RLF_PROTOCOL_ERROR, "a malformed reply");
    }
    return in;
}
/* a char * argument the program may have written into: the same number of bytes back */
static void rlf_back_s(rlf_in *in, char *s) {
    size_t n = 0;
    char *got = rlf_get_sn(in, &n);
    if (in->bad || (s == NULL) != (got == NULL) || (s && n != strlen(s))) {
        in->bad = 1;
    } else if (s && memcmp(s, got, n) != 0) {
        memcpy(s, got, n);
    }
    free(got);
}
static void rlf_end(rlf_in *in) {
    if (in->bad || in->n != 0) rlf_die(RLF_PROTOCOL_ERROR, "a malformed reply");
    free(in->frame);
}

/* -- the program's side: the server --------------------------------------------------- */
typedef void (*rlf_handler)(rlf_in *in, rlf_out *o);

static void rlf_request_end(rlf_in *in) {
    if (in->bad || in->n != 0) rlf_sys_exit(1); /* not a request of the tests */
}
static void rlf_put_back_s(rlf_out *o, const char *s, size_t n) {
    rlf_put_byte(o, s != NULL);
    if (s) {
        uint64_t k = n;
        rlf_raw(o, &k, 8);
        rlf_raw(o, s, n);
    }
}
static int rlf_serve(rlf_handler *table, uint32_t n) {
    for (;;) {
        rlf_in in;
        uint32_t k = 0;
        if (rlf_recv(&in) != 0) return 0; /* the tests are done */
        rlf_take(&in, &k, 4);
        if (in.bad || k >= n) return 1;
        rlf_out o = {0, 0, 0};
        table[k](&in, &o);
        free(in.frame);
        if (!rlf_send(&o)) return 0;
        free(o.b);
    }
}
#endif
