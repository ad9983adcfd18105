package main

// One spawned command as envd sees it (envd/child.py): its pipes read by a goroutine each into one channel (arrival
// order, at most maxPending chunks held: a consumer slower than the process blocks the process on a full pipe,
// never grows envd's memory), its exit seen without reaping it (waitid WNOWAIT, so its process group can still be
// killed by its pid), and its reaping once what it started is gone.

import (
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	readChunk  = 64 << 10
	maxPending = 8
	// the processes a command's start gives oom_score_adj 1000 at most: itself and what it forked before envd's
	// write (a fork bomb's are the pid limit's business, not this walk's)
	firstToGoMax = 256
	// a command still inside its exec is tried again this often, this many times (envd/child.py, the same)
	firstToGoRetry = time.Millisecond
	firstToGoTries = 50
)

// output is a chunk of the process's stdout (stream 1) or stderr (stream 2).
type output struct {
	stream int
	data   []byte
}

// readBuffers holds the pipes' read buffers between commands.
var readBuffers = sync.Pool{New: func() any { b := make([]byte, readChunk); return &b }}

// budget is the bytes of output still to be kept; the rest is read and dropped.
type budget struct {
	mu        sync.Mutex
	left      int64
	truncated bool
}

func (b *budget) take(data []byte) []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	if int64(len(data)) <= b.left {
		b.left -= int64(len(data))
		return data
	}
	b.truncated = true
	kept := data[:b.left]
	b.left = 0
	return kept
}

type child struct {
	pid    int
	out    chan output
	exited chan struct{} // closed once the process exited (it is not reaped yet)
	pipes  chan struct{} // closed once stdout and stderr both reached EOF (or were closed)
	quit   chan struct{} // closed by close(): readers stop
	stdin  *os.File      // envd's end of the stdin pipe; nil without stdin
	reads  []*os.File
	// the process as a file descriptor (nil where the kernel has none: gVisor): its exit is watched and it is reaped
	// through it, so neither a reused pid nor the stray reaper can take its status
	pidfd *os.File
	once  sync.Once
}

// lookPath finds argv0 on the command's own PATH, as execvpe does: the first executable file; EACCES when only
// files that are not executable were found, ENOENT when none. A relative entry (".", "bin", an empty one) is
// looked in from the command's cwd, where the exec happens: looked in from envd's own, a script in cwd was 127,
// and one of envd's directory's was run from cwd, where it is not.
func lookPath(argv0 string, path string, cwd string) (string, error) {
	if strings.Contains(argv0, "/") {
		return argv0, nil
	}
	var firstErr error
	for _, dir := range strings.Split(path, ":") {
		candidate := dir + "/" + argv0
		if dir == "" {
			candidate = argv0
		}
		checked := candidate
		if !strings.HasPrefix(candidate, "/") {
			checked = cwd + "/" + candidate
		}
		var st unix.Stat_t
		if err := unix.Stat(checked, &st); err != nil {
			if err != unix.ENOENT && err != unix.ENOTDIR && firstErr == nil {
				firstErr = err
			}
			continue
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR && unix.Access(checked, unix.X_OK) == nil {
			return candidate, nil
		}
		if firstErr == nil {
			firstErr = unix.EACCES
		}
	}
	if firstErr == nil {
		firstErr = unix.ENOENT
	}
	return "", firstErr
}

// spawn starts argv in a new session; the error is exec's (ENOENT, EACCES, ...).
func spawn(argv []string, cwd string, env []string, pathVar string, withStdin bool, b *budget) (*child, error) {
	exe, err := lookPath(argv[0], pathVar, cwd)
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return nil, err
	}
	var inR, inW *os.File
	if withStdin {
		inR, inW, err = os.Pipe()
	} else {
		inR, err = os.Open(os.DevNull)
	}
	if err != nil {
		for _, f := range []*os.File{outR, outW, errR, errW} {
			f.Close()
		}
		return nil, err
	}
	pid, err := syscall.ForkExec(exe, argv, &syscall.ProcAttr{
		Dir:   cwd,
		Env:   env,
		Files: []uintptr{inR.Fd(), outW.Fd(), errW.Fd()},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	})
	for _, f := range []*os.File{outW, errW, inR} {
		f.Close()
	}
	if err != nil {
		for _, f := range []*os.File{outR, errR, inW} {
			if f != nil {
				f.Close()
			}
		}
		return nil, err
	}
	firstToGo(pid)
	var pidfd *os.File
	// opened at once: only envd reaps its child and it has not yet, so the pid is still this process
	if fd, err := unix.PidfdOpen(pid, unix.O_NONBLOCK); err == nil {
		pidfd = os.NewFile(uintptr(fd), "pidfd")
	}
	c := &child{
		pid:    pid,
		pidfd:  pidfd,
		out:    make(chan output, maxPending),
		exited: make(chan struct{}),
		pipes:  make(chan struct{}),
		quit:   make(chan struct{}),
		stdin:  inW,
		reads:  []*os.File{outR, errR},
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go c.pump(outR, 1, b, &wg)
	go c.pump(errR, 2, b, &wg)
	go func() { wg.Wait(); close(c.pipes) }()
	go c.watchExit()
	return c, nil
}

// firstToGo makes a command, and every process it starts later, the sandbox's first choice for the OOM killer.
//
// The killer takes the process with the most memory, and envd (about 9 MB resident, most of it its binary's pages)
// was that process once a command's memory was spread over many smaller ones (a parallel build, a test runner's
// workers): envd died, the sandbox with it, and the rollout was an infrastructure retry. oom_score_adj 1000 adds
// the whole memory limit to a process's score, so any command's process goes before envd (0). A process may lower
// its own back to 0 (it needs no privilege to), so this is the default order, not a wall. Written once the command
// has exec'd (ForkExec returns then; before, it is non-dumpable like envd and its /proc files are root's), so what
// it forked before the write inherited 0 (a shell's workers, started while envd waited for a core): its
// descendants found then are given 1000 too, each written before its children are listed, so one forked after the
// write inherits 1000 and one forked before is listed (envd/child.py, first_to_go).
func firstToGo(pid int) {
	firstToGoTry(pid, 0)
}

// firstToGoTry is firstToGo's `tries`-th try: a command still inside its exec is tried again every millisecond, 50
// times at most (timers, not a goroutine that sleeps; a binary it may not read stays non-dumpable for good).
func firstToGoTry(pid, tries int) {
	todo := []int{pid}
	for seen := 0; len(todo) > 0 && seen < firstToGoMax; seen++ {
		target := todo[len(todo)-1]
		todo = todo[:len(todo)-1]
		fd, err := unix.Open("/proc/"+strconv.Itoa(target)+"/oom_score_adj", unix.O_WRONLY|unix.O_CLOEXEC, 0)
		if err == unix.EACCES && target == pid {
			// still inside its exec: the kernel closes the exec's close-on-exec pipe (ForkExec returns) before it
			// makes the process dumpable, and until then its /proc files are root's; refused so, the command and
			// all it started kept 0
			if tries < firstToGoTries {
				time.AfterFunc(firstToGoRetry, func() { firstToGoTry(pid, tries+1) })
			}
			continue
		}
		if err != nil {
			continue // gone already, or no /proc
		}
		_, err = unix.Write(fd, []byte("1000"))
		unix.Close(fd)
		if err == nil {
			todo = append(todo, children(target)...)
		}
	}
}

// children lists a process's children, from each of its threads' children file (none where the kernel has none).
func children(pid int) []int {
	dir := "/proc/" + strconv.Itoa(pid) + "/task/"
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var found []int
	for _, t := range tasks {
		data, err := os.ReadFile(dir + t.Name() + "/children")
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(data)) {
			if c, err := strconv.Atoi(f); err == nil {
				found = append(found, c)
			}
		}
	}
	return found
}

// pump forwards one pipe's output until EOF or close(); past the budget it reads and drops.
func (c *child) pump(f *os.File, stream int, b *budget, wg *sync.WaitGroup) {
	defer wg.Done()
	buf := readBuffers.Get().(*[]byte)
	defer readBuffers.Put(buf)
	for {
		n, err := f.Read(*buf)
		if n > 0 {
			if kept := b.take((*buf)[:n]); len(kept) > 0 {
				// a copy of what was read, the consumer's: a command's output is mostly a few bytes, and a 64 KiB
				// buffer per chunk was most of envd's garbage (and so of its CPU, in the collector)
				select {
				case c.out <- output{stream, append([]byte(nil), kept...)}:
				case <-c.quit:
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// watchExit closes `exited` once the process has exited, leaving it unreaped (WNOWAIT): until it is reaped its pid,
// and so its process group's id, cannot be reused. With a pidfd the exit is watched on Go's poller (no thread
// waits); without one (gVisor), or where the kernel refuses waitid on it, a goroutine blocks in waitid by pid.
func (c *child) watchExit() {
	defer close(c.exited)
	var info unix.Siginfo
	if c.pidfd != nil {
		if rc, err := c.pidfd.SyscallConn(); err == nil {
			var werr error
			err = rc.Read(func(fd uintptr) bool {
				werr = unix.Waitid(unix.P_PIDFD, int(fd), &info, unix.WEXITED|unix.WNOWAIT, nil)
				return werr != unix.EAGAIN && werr != unix.EINTR // EAGAIN while it runs (PIDFD_NONBLOCK)
			})
			if err == nil && (werr == nil || werr == unix.ECHILD) {
				return // exited, or reaped already (by a Reset's stray reaper: it was killed)
			}
		}
	}
	for {
		err := unix.Waitid(unix.P_PID, c.pid, &info, unix.WEXITED|unix.WNOWAIT, nil)
		if err != unix.EINTR {
			return // exited, or no longer envd's child (reaped by a Reset's stray reaper: it was killed)
		}
	}
}

func (c *child) hasExited() bool {
	select {
	case <-c.exited:
		return true
	default:
		return false
	}
}

// reap returns the exit status (-N: killed by signal N) once exited, reaping it; ok false while it runs.
func (c *child) reap() (int, bool) {
	if !c.hasExited() {
		return 0, false
	}
	if c.pidfd != nil {
		return c.reapPidfd()
	}
	var ws unix.WaitStatus
	for {
		pid, err := unix.Wait4(c.pid, &ws, unix.WNOHANG, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil { // reaped by a Reset's stray reaper: it was killed
			return -int(unix.SIGKILL), true
		}
		if pid == 0 {
			return 0, false
		}
		break
	}
	if ws.Signaled() {
		return -int(ws.Signal()), true
	}
	return ws.ExitStatus(), true
}

// siginfo's fields after signo, errno and code (x/sys's Siginfo leaves them as bytes): the CLD_* union.
type sigchld struct {
	signo, errno, code, _ int32
	pid                   int32
	uid                   uint32
	status                int32
}

func (c *child) reapPidfd() (int, bool) {
	var info unix.Siginfo
	rc, err := c.pidfd.SyscallConn()
	if err != nil {
		return -int(unix.SIGKILL), true
	}
	var werr error
	_ = rc.Control(func(fd uintptr) {
		for {
			werr = unix.Waitid(unix.P_PIDFD, int(fd), &info, unix.WEXITED|unix.WNOHANG, nil)
			if werr != unix.EINTR {
				return
			}
		}
	})
	if werr != nil { // reaped by a Reset's stray reaper: it was killed
		return -int(unix.SIGKILL), true
	}
	si := (*sigchld)(unsafe.Pointer(&info))
	if si.pid == 0 {
		return 0, false
	}
	if si.code == cldKilled || si.code == cldDumped {
		return -int(si.status), true
	}
	return int(si.status), true
}

const (
	cldKilled = 2 // CLD_KILLED
	cldDumped = 3 // CLD_DUMPED
)

// feed writes data, then each chunk `more` yields as the process takes it, then closes stdin. A closed pipe ends it.
// w is c.stdin, taken before close() may clear it: a Write on a closed file returns an error, it does not block.
func (c *child) feed(w *os.File, data []byte, more func() ([]byte, bool)) {
	defer c.closeStdin()
	if len(data) > 0 {
		if _, err := w.Write(data); err != nil {
			return
		}
	}
	if more == nil {
		return
	}
	for {
		chunk, ok := more()
		if !ok {
			return
		}
		if _, err := w.Write(chunk); err != nil {
			return
		}
	}
}

var stdinMu sync.Mutex

func (c *child) closeStdin() {
	stdinMu.Lock()
	defer stdinMu.Unlock()
	if c.stdin != nil {
		c.stdin.Close()
		c.stdin = nil
	}
}

// close stops watching: the pipes' read ends (a process still holding the write ends gets EPIPE) and stdin.
func (c *child) close() {
	c.once.Do(func() {
		close(c.quit)
		for _, f := range c.reads {
			f.Close()
		}
		if c.pidfd != nil {
			c.pidfd.Close()
		}
	})
	c.closeStdin()
}
