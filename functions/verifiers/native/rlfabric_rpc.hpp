// The wire between a C++ program and its assert-style tests, which run in two sandboxes
// (docs/code-verifier.md, "C and C++: the tests in a sandbox of their own").
//
// Both binaries include this header, first in their translation unit (before any text of
// theirs, so no macro of theirs rewrites it): the program's, compiled with a generated
// `main` that answers calls (`rlfabric::serve`), and the tests', compiled with a generated
// stub for each function of the program they call (`rlfabric::call`). Requests arrive on fd
// 3 and frames leave on fd 4; fd 1 is the run's stderr, so nothing either prints is a frame.
//
// A frame is a 4-byte length (native order: both ends run on this machine) and a body.
// Request: u32 the function's index, then its arguments. Reply: u8 0, the return value,
// then each argument the function takes by non-const reference (copied back); or u8 1 and
// the message of an exception the function threw. Values travel by the static type both
// ends declare: integers as 8 bytes, float 4, double 8, bool 8 (0 or not), strings and
// containers as a u64 count and their items, std::optional as a u8 flag and the value,
// pairs and tuples item by item, a C string as a u8 (0: a null pointer) and a string.
//
// The tests' side parses whatever the program sent with a bound on every count (never more
// items than bytes left, frames up to 16 MiB): what arrives is a value the function could
// have returned, or a protocol error that fails the case. The program's process is
// untrusted; nothing it does to its own copy of this header reaches the tests.
//
// A container's overloads (and its header) are there only where the includer defined
// RLFABRIC_USES_<CONTAINER> first: the generated sources define those their types use, and
// the headers of all of them would double a small program's compile.
// a guard, not #pragma once: a precompiled header carries a copy of this text (native_pch.py)
#ifndef RLFABRIC_RPC_HPP
#define RLFABRIC_RPC_HPP
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
// read, write and _exit under names of the wire's own, bound to libc's symbols: <unistd.h>
// would declare truncate, link, access... in both translation units, and a program's own
// function of such a name would then be ambiguous (or its stub refused). The symbols are
// glibc's reserved aliases __read and __write: a program's `extern "C" int write(int)` is
// the global symbol "write", which the server would otherwise call for the channel
extern "C" long rlfabric_sys_read(int fd, void* p, std::size_t n) __asm__("__read");
extern "C" long rlfabric_sys_write(int fd, const void* p, std::size_t n) __asm__("__write");
extern "C" [[noreturn]] void rlfabric_sys_exit(int code) __asm__("_exit");
#ifdef RLFABRIC_USES_VECTOR
#include <vector>
#endif
#ifdef RLFABRIC_USES_MAP
#include <map>
#endif
#ifdef RLFABRIC_USES_SET
#include <set>
#endif
#ifdef RLFABRIC_USES_UNORDERED_MAP
#include <unordered_map>
#endif
#ifdef RLFABRIC_USES_UNORDERED_SET
#include <unordered_set>
#endif
#ifdef RLFABRIC_USES_OPTIONAL
#include <optional>
#endif

namespace rlfabric {

// the tests' exit codes (functions/verifiers/rpc.py)
enum : int { PROTOCOL_ERROR = 12, PROGRAM_GONE = 13 };
constexpr std::uint32_t MAX_FRAME = 16u << 20;

[[noreturn]] inline void die(int code, const char* what) {
    std::fflush(stdout);
    std::fprintf(stderr, "\nrlfabric: %s\n", what);
    std::fflush(stderr);
    rlfabric_sys_exit(code);
}

struct Out {
    std::string b;
    void raw(const void* p, std::size_t n) { b.append(static_cast<const char*>(p), n); }
};

struct In {
    const char* p;
    std::size_t n;
    bool bad = false;
    bool raw(void* dst, std::size_t k) {
        if (bad || k > n) {
            bad = true;
            return false;
        }
        std::memcpy(dst, p, k);
        p += k;
        n -= k;
        return true;
    }
    // a count of items, each at least one byte: never more than the bytes left
    std::uint64_t count() {
        std::uint64_t c = 0;
        raw(&c, 8);
        if (c > n) bad = true;
        return bad ? 0 : c;
    }
};

// -- values ------------------------------------------------------------------------------
template <class T>
std::enable_if_t<std::is_integral_v<T>> put(Out& o, const T& v) {
    if constexpr (std::is_same_v<T, bool>) {
        std::uint64_t x = v ? 1 : 0;
        o.raw(&x, 8);
    } else if constexpr (std::is_signed_v<T>) {
        std::int64_t x = v;
        o.raw(&x, 8);
    } else {
        std::uint64_t x = v;
        o.raw(&x, 8);
    }
}
template <class T>
std::enable_if_t<std::is_integral_v<T>> get(In& i, T& v) {
    std::uint64_t x = 0;
    i.raw(&x, 8);
    if constexpr (std::is_same_v<T, bool>)
        v = x != 0;
    else
        v = static_cast<T>(x);
}
inline void put(Out& o, const float& v) { o.raw(&v, 4); }
inline void get(In& i, float& v) { i.raw(&v, 4); }
inline void put(Out& o, const double& v) { o.raw(&v, 8); }
inline void get(In& i, double& v) { i.raw(&v, 8); }

inline void put_bytes(Out& o, const char* s, std::size_t n) {
    std::uint64_t c = n;
    o.raw(&c, 8);
    o.raw(s, n);
}
inline void put(Out& o, const std::string& v) { put_bytes(o, v.data(), v.size()); }
inline void get(In& i, std::string& v) {
    std::uint64_t c = i.count();
    v.assign(i.bad ? "" : i.p, static_cast<std::size_t>(c));
    i.p += c;
    i.n -= c;
}
// a C string: a flag (0: a null pointer), then its bytes; read into a fresh malloc'd copy
// (the caller owns it: the tests may free() what a function returned, as in one process)
inline void put(Out& o, const char* const& v) {
    std::uint8_t f = v != nullptr;
    o.raw(&f, 1);
    if (v) put_bytes(o, v, std::strlen(v));
}
inline void put(Out& o, char* const& v) { put(o, static_cast<const char* const&>(v)); }
inline char* get_cstr(In& i) {
    std::uint8_t f = 0;
    i.raw(&f, 1);
    if (!f || i.bad) return nullptr;
    std::uint64_t c = i.count();
    char* s = static_cast<char*>(std::malloc(c + 1));
    if (!s) die(PROTOCOL_ERROR, "out of memory for a string of the program");
    std::memcpy(s, i.p, c);
    s[c] = 0;
    i.p += c;
    i.n -= c;
    return s;
}
inline void get(In& i, const char*& v) { v = get_cstr(i); }
inline void get(In& i, char*& v) { v = get_cstr(i); }

// declared before any is defined: a vector of maps of optionals finds each of them
#ifdef RLFABRIC_USES_VECTOR
template <class T, class A> void put(Out& o, const std::vector<T, A>& v);
template <class T, class A> void get(In& i, std::vector<T, A>& v);
#endif
#ifdef RLFABRIC_USES_MAP
template <class K, class V, class C, class A> void put(Out& o, const std::map<K, V, C, A>& v);
template <class K, class V, class C, class A> void get(In& i, std::map<K, V, C, A>& v);
#endif
#ifdef RLFABRIC_USES_SET
template <class T, class C, class A> void put(Out& o, const std::set<T, C, A>& v);
template <class T, class C, class A> void get(In& i, std::set<T, C, A>& v);
#endif
#ifdef RLFABRIC_USES_UNORDERED_MAP
template <class K, class V, class H, class E, class A>
void put(Out& o, const std::unordered_map<K, V, H, E, A>& v);
template <class K, class V, class H, class E, class A> void get(In& i, std::unordered_map<K, V, H, E, A>& v);
#endif
#ifdef RLFABRIC_USES_UNORDERED_SET
template <class T, class H, class E, class A> void put(Out& o, const std::unordered_set<T, H, E, A>& v);
template <class T, class H, class E, class A> void get(In& i, std::unordered_set<T, H, E, A>& v);
#endif
template <class A, class B> void put(Out& o, const std::pair<A, B>& v);
template <class A, class B> void get(In& i, std::pair<A, B>& v);
template <class... T> void put(Out& o, const std::tuple<T...>& v);
template <class... T> void get(In& i, std::tuple<T...>& v);
#ifdef RLFABRIC_USES_OPTIONAL
template <class T> void put(Out& o, const std::optional<T>& v);
template <class T> void get(In& i, std::optional<T>& v);
#endif

template <class C> void put_items(Out& o, const C& v) {
    std::uint64_t c = v.size();
    o.raw(&c, 8);
    for (const auto& x : v) put(o, x);
}
#ifdef RLFABRIC_USES_VECTOR
template <class T, class A> void put(Out& o, const std::vector<T, A>& v) {
    std::uint64_t c = v.size();
    o.raw(&c, 8);
    for (std::size_t k = 0; k < v.size(); k++) put(o, static_cast<const T&>(v[k]));  // vector<bool>
}
template <class T, class A> void get(In& i, std::vector<T, A>& v) {
    std::uint64_t c = i.count();
    v.clear();
    v.reserve(c);
    for (std::uint64_t k = 0; k < c && !i.bad; k++) {
        T x{};
        get(i, x);
        v.push_back(std::move(x));
    }
}
#endif
template <class M> void get_map(In& i, M& v) {
    std::uint64_t c = i.count();
    v.clear();
    for (std::uint64_t k = 0; k < c && !i.bad; k++) {
        typename M::key_type key{};
        typename M::mapped_type val{};
        get(i, key);
        get(i, val);
        v.emplace(std::move(key), std::move(val));
    }
}
template <class S> void get_set(In& i, S& v) {
    std::uint64_t c = i.count();
    v.clear();
    for (std::uint64_t k = 0; k < c && !i.bad; k++) {
        typename S::key_type key{};
        get(i, key);
        v.insert(std::move(key));
    }
}
#ifdef RLFABRIC_USES_MAP
template <class K, class V, class C, class A> void put(Out& o, const std::map<K, V, C, A>& v) { put_items(o, v); }
template <class K, class V, class C, class A> void get(In& i, std::map<K, V, C, A>& v) { get_map(i, v); }
#endif
#ifdef RLFABRIC_USES_SET
template <class T, class C, class A> void put(Out& o, const std::set<T, C, A>& v) { put_items(o, v); }
template <class T, class C, class A> void get(In& i, std::set<T, C, A>& v) { get_set(i, v); }
#endif
#ifdef RLFABRIC_USES_UNORDERED_MAP
template <class K, class V, class H, class E, class A>
void put(Out& o, const std::unordered_map<K, V, H, E, A>& v) {
    put_items(o, v);
}
template <class K, class V, class H, class E, class A> void get(In& i, std::unordered_map<K, V, H, E, A>& v) {
    get_map(i, v);
}
#endif
#ifdef RLFABRIC_USES_UNORDERED_SET
template <class T, class H, class E, class A> void put(Out& o, const std::unordered_set<T, H, E, A>& v) {
    put_items(o, v);
}
template <class T, class H, class E, class A> void get(In& i, std::unordered_set<T, H, E, A>& v) { get_set(i, v); }
#endif
template <class A, class B> void put(Out& o, const std::pair<A, B>& v) {
    put(o, v.first);
    put(o, v.second);
}
template <class A, class B> void get(In& i, std::pair<A, B>& v) {
    get(i, v.first);
    get(i, v.second);
}
template <class... T> void put(Out& o, const std::tuple<T...>& v) {
    std::apply([&](const auto&... x) { (put(o, x), ...); }, v);
}
template <class... T> void get(In& i, std::tuple<T...>& v) {
    std::apply([&](auto&... x) { (get(i, x), ...); }, v);
}
#ifdef RLFABRIC_USES_OPTIONAL
template <class T> void put(Out& o, const std::optional<T>& v) {
    std::uint8_t f = v.has_value();
    o.raw(&f, 1);
    if (v) put(o, *v);
}
template <class T> void get(In& i, std::optional<T>& v) {
    std::uint8_t f = 0;
    i.raw(&f, 1);
    if (!f || i.bad) {
        v.reset();
        return;
    }
    T x{};
    get(i, x);
    v = std::move(x);
}

#endif
// -- frames ------------------------------------------------------------------------------
// false: the other end is gone (EOF or an error)
inline bool write_all(const char* p, std::size_t n) {
    while (n) {
        long w = rlfabric_sys_write(4, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        p += w;
        n -= static_cast<std::size_t>(w);
    }
    return true;
}
inline bool read_all(char* p, std::size_t n) {
    while (n) {
        long r = rlfabric_sys_read(3, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        p += r;
        n -= static_cast<std::size_t>(r);
    }
    return true;
}
inline bool send_frame(const Out& o) {
    std::uint32_t n = static_cast<std::uint32_t>(o.b.size());
    return write_all(reinterpret_cast<const char*>(&n), 4) && write_all(o.b.data(), o.b.size());
}
// 0: a frame in `body`; 1: the channel ended; 2: a frame over MAX_FRAME
inline int recv_frame(std::string& body) {
    std::uint32_t n = 0;
    if (!read_all(reinterpret_cast<char*>(&n), 4)) return 1;
    if (n > MAX_FRAME) return 2;
    body.resize(n);
    return read_all(body.data(), n) ? 0 : 1;
}

template <class A>
constexpr bool copied_back_v =
    std::is_lvalue_reference_v<A> && !std::is_const_v<std::remove_reference_t<A>>;

// -- the tests' side: a stub per function of the program --------------------------------
// `A...` are the parameter types exactly as the program declared them (the stub has the
// same signature, so the tests compile with the same conversions as in one process).
template <class R, class... A> R call(std::uint32_t fn, const char* name, A&&... args) {
    Out o;
    o.raw(&fn, 4);
    (put(o, static_cast<const std::decay_t<A>&>(args)), ...);
    if (o.b.size() > MAX_FRAME) die(PROTOCOL_ERROR, "the arguments of a call are over the 16 MiB frame limit");
    if (!send_frame(o)) die(PROGRAM_GONE, "the program closed the channel (it exited or crashed)");
    std::string body;
    int got = recv_frame(body);
    if (got == 1) die(PROGRAM_GONE, "the program closed the channel (it exited or crashed)");
    if (got == 2) die(PROTOCOL_ERROR, "the program sent a frame over the 16 MiB limit");
    In i{body.data(), body.size()};
    std::uint8_t kind = 2;
    i.raw(&kind, 1);
    if (kind == 1) {
        std::string what;
        get(i, what);
        if (i.bad) die(PROTOCOL_ERROR, "a malformed reply");
        throw std::runtime_error(std::string(name) + " (in the program) threw: " + what.substr(0, 1000));
    }
    if (kind != 0) die(PROTOCOL_ERROR, "a malformed reply");
    std::conditional_t<std::is_void_v<R>, int, std::decay_t<R>> r{};
    if constexpr (!std::is_void_v<R>) get(i, r);
    auto back = [&](auto& a) {
        using T = std::remove_reference_t<decltype(a)>;
        if constexpr (!std::is_const_v<T>) {
            T x{};
            get(i, x);
            if (!i.bad) a = std::move(x);
        }
    };
    (
        [&] {
            if constexpr (copied_back_v<A>) back(args);
        }(),
        ...);
    if (i.bad || i.n != 0) die(PROTOCOL_ERROR, "a malformed reply");
    if constexpr (!std::is_void_v<R>) return r;
}

// -- the program's side: the server ------------------------------------------------------
// a function's type as the stubs declare it (they drop `noexcept`)
template <class F> struct plain {
    using type = F;
};
template <class R, class... A> struct plain<R (*)(A...) noexcept> {
    using type = R (*)(A...);
};
template <class F, class G> constexpr bool same_signature_v = std::is_same_v<typename plain<F>::type, G>;
// whether `&::f` is (or, where a header overloads the name, names) a function of type G:
// `is(&::f)` takes G where the overload set has one of that type, and a lone function of
// another type deduces X (a set of several deduces nothing)
template <class G> struct signature_of {
    static constexpr bool is(G) { return true; }
    template <class X> static constexpr bool is(X) { return same_signature_v<X, G>; }
};

using Handler = void (*)(void* fn, In& i, Out& o);

template <class P, class T> decltype(auto) pass(T& a) {
    if constexpr (std::is_lvalue_reference_v<P>)
        return (a);
    else
        return std::move(a);
}

template <class R, class... A, std::size_t... K>
void invoke(R (*f)(A...), In& i, Out& o, std::index_sequence<K...>) {
    std::tuple<std::decay_t<A>...> args{};
    (get(i, std::get<K>(args)), ...);
    std::uint8_t ok = 0, threw = 1;
    if (i.bad || i.n != 0) rlfabric_sys_exit(1);  // not a request of the tests
    try {
        if constexpr (std::is_void_v<R>) {
            f(pass<A>(std::get<K>(args))...);
            o.raw(&ok, 1);
        } else {
            std::decay_t<R> r = f(pass<A>(std::get<K>(args))...);
            o.raw(&ok, 1);
            put(o, static_cast<const std::decay_t<R>&>(r));
        }
        (
            [&] {
                if constexpr (copied_back_v<A>) put(o, std::get<K>(args));
            }(),
            ...);
    } catch (const std::exception& e) {
        o.b.clear();
        o.raw(&threw, 1);
        put(o, std::string(e.what()));
    } catch (...) {
        o.b.clear();
        o.raw(&threw, 1);
        put(o, std::string("an exception that is not a std::exception"));
    }
}

template <class R, class... A> struct Entry {
    static void handle(void* fn, In& i, Out& o) {
        invoke(reinterpret_cast<R (*)(A...)>(fn), i, o, std::index_sequence_for<A...>{});
    }
};

struct Served {
    void* fn;
    Handler handle;
};
template <class R, class... A> Served fn(R (*f)(A...)) {
    return Served{reinterpret_cast<void*>(f), &Entry<R, A...>::handle};
}

inline int serve(const Served* table, std::size_t n) {
    std::string body;
    for (;;) {
        if (recv_frame(body) != 0) return 0;  // the tests are done
        In i{body.data(), body.size()};
        std::uint32_t k = 0;
        if (!i.raw(&k, 4) || k >= n) return 1;
        Out o;
        table[k].handle(table[k].fn, i, o);
        if (!send_frame(o)) return 0;
    }
}

}  // namespace rlfabric
#endif
