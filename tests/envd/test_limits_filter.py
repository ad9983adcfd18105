"""envd's seccomp filter (envd/kernel.py, the same program as envd/go/limits.go), run on sample calls by a small
classic-BPF interpreter: every ABI's prlimit64 that sets another process's limits is refused, and nothing else.
tests/security/test_envd_limits.py runs the real filter in real sandboxes, through the native ABI."""

from __future__ import annotations

import errno
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from envd.kernel import (
    JEQ_K,
    LD_ABS,
    PRLIMIT_ABIS,
    REFUSED_CALLS,
    RET_K,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_ERRNO,
    prlimit_filter,
    refused_filter,
)

DENY = SECCOMP_RET_ERRNO | errno.EPERM
X86_64, I386 = 0xC000003E, 0x40000003
HIGH = 1 << 32  # a pointer with only its high word set (memory mapped at 4 GiB)


def run(nr: int, arch: int, *args: int, make: Callable[[], list[tuple[int, int, int, int]]] = prlimit_filter) -> int:
    """What the filter answers for a call: struct seccomp_data is nr, arch, ip, six 64-bit arguments."""
    data = struct.pack("<IIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    program, pc, acc = make(), 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == LD_ABS:
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code == JEQ_K:
            pc += 1 + (jt if acc == k else jf)
        else:
            assert code == RET_K
            return k


@pytest.mark.parametrize(("arch", "nr", "wide"), PRLIMIT_ABIS)
def test_setting_another_processs_limits_is_refused_on_every_abi(arch: int, nr: int, wide: bool) -> None:
    assert run(nr, arch, 1, 0, 0x7000) == DENY  # envd's limits (RLIMIT_CPU, new limits at 0x7000)
    assert run(nr, arch, 42, 7, 0x7000, 0x8000) == DENY
    assert run(nr, arch, 0, 0, 0x7000) == SECCOMP_RET_ALLOW  # its own
    assert run(nr, arch, 1, 0, 0, 0x8000) == SECCOMP_RET_ALLOW  # reading another's
    # a pointer in the high word only: refused where the kernel reads all 64 bits (x32 calls the common entry)
    assert run(nr, arch, 1, 0, HIGH) == (DENY if wide else SECCOMP_RET_ALLOW)


def test_every_other_call_is_allowed() -> None:
    assert run(0, X86_64, 1, 0, 0x7000) == SECCOMP_RET_ALLOW  # read(2)
    assert run(302, I386, 1, 0, 0x7000) == SECCOMP_RET_ALLOW  # 302 is another call on i386
    assert run(302, 0x12345678, 1, 0, 0x7000) == SECCOMP_RET_ALLOW  # an ABI this host has none of
    assert [wide for arch, _, wide in PRLIMIT_ABIS if arch == X86_64] == [True, True]


@pytest.mark.parametrize(("arch", "numbers"), REFUSED_CALLS)
def test_asynchronous_io_is_refused_on_every_abi_and_nothing_else(arch: int, numbers: tuple[int, ...]) -> None:
    for nr in numbers:
        assert run(nr, arch, make=refused_filter) == SECCOMP_RET_ERRNO | errno.ENOSYS
    for nr in {1, 2, 39, 207, 302, 424, 428} - set(numbers):
        assert run(nr, arch, make=refused_filter) == SECCOMP_RET_ALLOW
    assert run(206, 0x12345678, make=refused_filter) == SECCOMP_RET_ALLOW  # an ABI this host has none of
    assert run(245, X86_64, make=refused_filter) == SECCOMP_RET_ALLOW  # i386's io_setup is another call on x86_64


def test_the_go_envd_refuses_the_same_calls() -> None:
    go = (Path(__file__).parents[2] / "envd/go/limits.go").read_text()
    block = go[go.index("var refusedCalls") : go.index("func refusedFilter")]
    rows = re.findall(r"\{(\w+(?:\.\w+)?), \[\]uint32\{([^}]*)\}\}", block)
    arches = {"unix.AUDIT_ARCH_X86_64": X86_64, "auditArchI386": I386, "unix.AUDIT_ARCH_AARCH64": 0xC00000B7}
    arches["auditArchARM"] = 0x40000028
    x32 = 0x40000000
    parsed = [
        (arches[a], tuple(x32 | int(n.split("|")[1]) if "|" in n else int(n) for n in ns.split(","))) for a, ns in rows
    ]
    assert parsed == list(REFUSED_CALLS)
