package main

// Every process of a sandbox runs as envd's own uid, and the kernel lets a process set the resource limits of any
// other process of its uid (prlimit): a command could lower envd's (a CPU time of one second: the kernel kills it,
// the sandbox dies, and a rollout heading for 0 becomes an infrastructure retry) or a concurrent command's (the
// grader's), and every command envd starts later inherits envd's. No capability or uid tells them apart here, so a
// seccomp filter does: installed on envd at start, it is inherited by everything envd runs, and it refuses to set
// another process's limits. A process's own (setrlimit, ulimit, prlimit on pid 0) stay its to set.

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	seccompSetModeFilter = 1
	seccompFlagTsync     = 1
	seccompRetAllow      = 0x7fff0000
	seccompRetErrno      = 0x00050000
	auditArchI386        = 0x40000003
	auditArchARM         = 0x40000028
	x32SyscallBit        = 0x40000000
	// struct seccomp_data: nr, arch, instruction pointer, then six 64-bit arguments (little-endian: low word first)
	offNr, offArch, offArg0, offArg1, offArg2, offArg2High = 0, 4, 16, 24, 32, 36
)

// the prlimit64 syscall's number on each ABI a process of this host may call it through, and whether the kernel
// reads its pointer argument as 64 bits
var prlimitABIs = []struct {
	arch uint32
	nr   uint32
	wide bool
}{
	{unix.AUDIT_ARCH_X86_64, 302, true},
	{unix.AUDIT_ARCH_X86_64, x32SyscallBit | 302, true}, // the common entry: it reads the whole register
	{auditArchI386, 340, false},
	{unix.AUDIT_ARCH_AARCH64, 261, true},
	{auditArchARM, 369, false},
}

// bpf is a classic BPF program being assembled, with jumps to labels resolved at the end.
type bpf struct {
	code   []unix.SockFilter
	labels map[string]int
	jumps  map[int][2]string // instruction -> (true label, false label); "" falls through
}

func (p *bpf) load(offset uint32) {
	p.code = append(p.code, unix.SockFilter{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: offset})
}

func (p *bpf) jeq(k uint32, yes, no string) {
	p.jumps[len(p.code)] = [2]string{yes, no}
	p.code = append(p.code, unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, K: k})
}

func (p *bpf) ret(k uint32) {
	p.code = append(p.code, unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: k})
}

func (p *bpf) label(name string) { p.labels[name] = len(p.code) }

func (p *bpf) resolve() []unix.SockFilter {
	for at, targets := range p.jumps {
		for i, name := range targets {
			if name == "" {
				continue
			}
			offset := p.labels[name] - at - 1
			if offset < 0 || offset > 255 {
				panic(fmt.Sprintf("bpf: a jump of %d instructions to %s", offset, name))
			}
			if i == 0 {
				p.code[at].Jt = uint8(offset)
			} else {
				p.code[at].Jf = uint8(offset)
			}
		}
	}
	return p.code
}

// prlimitFilter refuses (EPERM) prlimit64 with a pid other than 0 (the caller) and new limits to set; reading
// another process's limits stays allowed, as does every other call.
func prlimitFilter() []unix.SockFilter {
	p := &bpf{labels: map[string]int{}, jumps: map[int][2]string{}}
	p.load(offArch)
	for i := range prlimitABIs {
		p.jeq(prlimitABIs[i].arch, "", "arch"+string(rune('0'+i)))
		p.load(offNr)
		check := "narrow"
		if prlimitABIs[i].wide {
			check = "wide"
		}
		p.jeq(prlimitABIs[i].nr, check, "arch"+string(rune('0'+i))) // or another ABI's number on this arch
		p.label("arch" + string(rune('0'+i)))
		if i < len(prlimitABIs)-1 {
			p.load(offArch)
		}
	}
	p.ret(seccompRetAllow)
	for _, width := range []string{"wide", "narrow"} {
		p.label(width)
		p.load(offArg0) // pid_t: the kernel reads the low 32 bits
		p.jeq(0, "allow", "")
		p.load(offArg2)
		if width == "wide" {
			p.jeq(0, "", "deny")
			p.load(offArg2High)
		}
		p.jeq(0, "allow", "deny")
	}
	p.label("allow")
	p.ret(seccompRetAllow)
	p.label("deny")
	p.ret(seccompRetErrno | uint32(unix.EPERM))
	return p.resolve()
}

// The kernel's asynchronous I/O, refused with ENOSYS (programs that use it fall back to threads: libaio's, libuv):
// io_setup takes its events from one count for the whole host (fs.aio-max-nr, 65536 by default), so one sandbox that
// took them all failed io_setup in every other sandbox of the host; io_uring is a large part of the kernel to expose
// to hostile code for no gain here. Each ABI's numbers (x32's io_setup has one of its own).
var refusedCalls = []struct {
	arch uint32
	nrs  []uint32
}{
	{unix.AUDIT_ARCH_X86_64, []uint32{206, 425, 426, 427, x32SyscallBit | 543, x32SyscallBit | 425, x32SyscallBit | 426, x32SyscallBit | 427}},
	{auditArchI386, []uint32{245, 425, 426, 427}},
	{unix.AUDIT_ARCH_AARCH64, []uint32{0, 425, 426, 427}},
	{auditArchARM, []uint32{243, 425, 426, 427}},
}

// refusedFilter returns ENOSYS for refusedCalls and allows every other call.
func refusedFilter() []unix.SockFilter {
	p := &bpf{labels: map[string]int{}, jumps: map[int][2]string{}}
	p.load(offArch)
	for i, abi := range refusedCalls {
		next := "abi" + string(rune('0'+i))
		p.jeq(abi.arch, "", next)
		p.load(offNr)
		for _, nr := range abi.nrs {
			p.jeq(nr, "refuse", "")
		}
		p.ret(seccompRetAllow)
		p.label(next) // the accumulator still holds the arch
	}
	p.ret(seccompRetAllow)
	p.label("refuse")
	p.ret(seccompRetErrno | uint32(unix.ENOSYS))
	return p.resolve()
}

// Go's runtime takes a fault signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSTKFLT, SIGSYS) that kill() did not
// send (si_code other than SI_USER) for a fault of its own, and dies ("unexpected signal"), envd's handlers of every
// signal notwithstanding: a command's tgkill(1, tid, SIGSEGV), or an rt_sigqueueinfo to any of envd's threads, killed
// PID 1 and the sandbox, and a rollout heading for 0 became an infrastructure retry. Those calls may not send them
// to envd: tgkill and rt_tgsigqueueinfo to thread group 1, and tkill, rt_sigqueueinfo and pidfd_send_signal (whose
// target may be any of envd's threads, or a pidfd of it) to anyone; nor may fcntl(F_SETSIG) choose one for a file's
// I/O signal, which goes to the file's owner (F_SETOWN: envd, say) with si_code POLL_IN. raise() and pthread_kill()
// are tgkill, so a process may still fault itself that way; kill() sends every signal as before.
var faultSignals = []uint32{4, 5, 7, 8, 11, 16, 31}

const fSetSig = 10 // fcntl's F_SETSIG, on every ABI

// the calls of each ABI that send a signal with a chosen si_code: their number, where the signal is, and whether
// only a target of thread group 1 is refused, or only fcntl's F_SETSIG (its command in arg1)
type signalCall struct {
	nr      uint32
	sigArg  uint32
	toGroup bool
	setSig  bool
}

var signalCalls = []struct {
	arch  uint32
	calls []signalCall
}{
	{unix.AUDIT_ARCH_X86_64, []signalCall{
		{200, offArg1, false, false}, {234, offArg2, true, false}, {129, offArg1, false, false},
		{297, offArg2, true, false}, {424, offArg1, false, false}, {72, offArg2, false, true},
		{x32SyscallBit | 200, offArg1, false, false}, {x32SyscallBit | 234, offArg2, true, false},
		{x32SyscallBit | 524, offArg1, false, false}, {x32SyscallBit | 536, offArg2, true, false},
		{x32SyscallBit | 424, offArg1, false, false}, {x32SyscallBit | 72, offArg2, false, true},
	}},
	{auditArchI386, []signalCall{
		{238, offArg1, false, false}, {270, offArg2, true, false}, {178, offArg1, false, false},
		{335, offArg2, true, false}, {424, offArg1, false, false}, {55, offArg2, false, true}, {221, offArg2, false, true},
	}},
	{unix.AUDIT_ARCH_AARCH64, []signalCall{
		{130, offArg1, false, false}, {131, offArg2, true, false}, {138, offArg1, false, false},
		{240, offArg2, true, false}, {424, offArg1, false, false}, {25, offArg2, false, true},
	}},
	{auditArchARM, []signalCall{
		{238, offArg1, false, false}, {268, offArg2, true, false}, {178, offArg1, false, false},
		{363, offArg2, true, false}, {424, offArg1, false, false}, {55, offArg2, false, true}, {221, offArg2, false, true},
	}},
}

// signalFilter refuses (EPERM) a fault signal to envd through signalCalls and allows every other call.
func signalFilter() []unix.SockFilter {
	p := &bpf{labels: map[string]int{}, jumps: map[int][2]string{}}
	name := func(i, j int) string { return fmt.Sprintf("call%d.%d", i, j) }
	p.load(offArch)
	for i, abi := range signalCalls {
		next := fmt.Sprintf("abi%d", i)
		p.jeq(abi.arch, "", next)
		p.load(offNr)
		for j, c := range abi.calls {
			p.jeq(c.nr, name(i, j), "")
		}
		p.ret(seccompRetAllow)
		p.label(next) // the accumulator still holds the arch
	}
	p.ret(seccompRetAllow)
	for i, abi := range signalCalls {
		for j, c := range abi.calls {
			p.label(name(i, j))
			if c.toGroup {
				p.load(offArg0)
				p.jeq(1, "", "allow")
			}
			if c.setSig {
				p.load(offArg1)
				p.jeq(fSetSig, "", "allow")
			}
			p.load(c.sigArg)
			p.jeq(0, "signal", "signal") // on to the signal's check, whatever it is
		}
	}
	p.label("signal")
	for _, sig := range faultSignals {
		p.jeq(sig, "refuse", "")
	}
	p.label("allow")
	p.ret(seccompRetAllow)
	p.label("refuse")
	p.ret(seccompRetErrno | uint32(unix.EPERM))
	return p.resolve()
}

// guardLimits installs prlimitFilter, refusedFilter and signalFilter on every thread of envd, and so on every process
// it starts from now on.
func guardLimits() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// a filter needs no_new_privs (the container has it already: its processes gain nothing through exec)
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return err
	}
	for _, filter := range [][]unix.SockFilter{prlimitFilter(), refusedFilter(), signalFilter()} {
		prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
		tid, _, errno := unix.Syscall(unix.SYS_SECCOMP, seccompSetModeFilter, seccompFlagTsync, uintptr(unsafe.Pointer(&prog)))
		if errno != 0 {
			return errno
		}
		if tid != 0 {
			return fmt.Errorf("thread %d could not take the filter", tid)
		}
	}
	return nil
}
