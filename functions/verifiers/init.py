"""The PID 1 of every run's namespace: a 181-byte static x86-64 program.

All it does is ignore SIGCHLD, then read its stdin (a pipe whose write end only the run's
supervisor holds) until EOF, then exit; its exit ends the namespace. Ignoring SIGCHLD has
the kernel reap the orphans it inherits (a shell's background command, a double fork), as
a host's init would: left as zombies, each held one of the run's processes (``nproc``)
until its forks failed. ``cat`` does the same, but each run
would pay for the dynamic loader, libc and its start-up (about 0.6 ms against 0.2 ms for
this one, spawned and ended), which was a tenth of the CPU of a short run.

Elsewhere than x86-64 ``image()`` is None and the zygote uses ``cat`` (which reaps nothing:
there, orphans stay zombies until the run ends).

Stdlib only (the zygote imports it).
"""

from __future__ import annotations

import platform
import struct

#: The program, at the start of its only segment:
#:         push 0                ; rt_sigaction(SIGCHLD, {SIG_IGN}, NULL, 8): the kernel's
#:         push 0                ; struct sigaction on the stack, from the top: its mask,
#:         push 0                ; restorer and flags (all 0), then its handler, SIG_IGN (1)
#:         push 1
#:         mov eax, 13
#:         mov edi, 17
#:         mov rsi, rsp
#:         xor edx, edx
#:         mov r10d, 8
#:         syscall               ; (a failure changes nothing else: the loop runs all the same)
#:   loop: xor eax, eax          ; read(0, rsp - 64, 64)
#:         xor edi, edi
#:         lea rsi, [rsp - 64]   ; the stack's red zone: mapped, and nothing else uses it
#:         mov edx, 64
#:         syscall
#:         test rax, rax
#:         jg loop               ; data: read on. EOF (0) or an error (< 0): done
#:         mov eax, 60           ; exit(0)
#:         xor edi, edi
#:         syscall
_CODE_X86_64 = bytes.fromhex(
    "6a00 6a00 6a00 6a01 b80d000000 bf11000000 4889e6 31d2 41ba08000000 0f05"
    "31c0 31ff 488d7424c0 ba40000000 0f05 4885c0 7feb b83c000000 31ff 0f05"
)
_BASE = 0x400000
_EHDR, _PHDR = 64, 56


def image() -> bytes | None:
    """A static ELF executable of the init, or None where none is built for this machine."""
    if platform.machine() != "x86_64":
        return None
    size = _EHDR + _PHDR + len(_CODE_X86_64)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, version 1
    # ET_EXEC for EM_X86_64, entry right after the headers, one program header, no sections
    ehdr = ident + struct.pack(
        "<HHIQQQIHHHHHH", 2, 0x3E, 1, _BASE + _EHDR + _PHDR, _EHDR, 0, 0, _EHDR, _PHDR, 1, 0, 0, 0
    )
    # one PT_LOAD of the whole file, readable and executable
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, _BASE, _BASE, size, size, 0x1000)
    return ehdr + phdr + _CODE_X86_64
