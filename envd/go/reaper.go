package main

// Finding and killing what envd's commands left behind (envd/reaper.py).
//
// envd is its processes' sub-reaper: a process that escapes its command's process group by setsid, a double fork
// or a cleared environment is re-parented to envd, never to init, so "everything envd started" is the subtree under
// envd in /proc. Killing it stops the subtree first (SIGSTOP, repeated until no new process shows up), so a fork
// bomb cannot outrun the kill, then SIGKILLs it and reaps what envd itself inherited.
//
// Where the kernel has no sub-reapers (gVisor), orphans go to init: the adopters are then envd and PID 1.

import (
	"bytes"
	"os"
	"sort"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

const (
	stopRounds = 200
	killRounds = 100
)

// proc is one line of the process table.
type proc struct {
	ppid    int
	pgid    int
	state   byte
	threads int
	start   uint64 // clock ticks after boot: with the pid, names a process across pid reuse
}

// dead: a zombie, which only waits for its parent to reap it. Not one whose main thread exited while its other
// threads run: /proc shows it Z as well (with its thread count), and it was left alive by every kill and Reset.
func (p proc) dead() bool {
	return p.state == 'Z' && p.threads <= 1
}

type procTable map[int]proc

var self = os.Getpid()

// readProcTable is pid -> proc for every visible process.
func readProcTable() procTable {
	table := procTable{}
	dir, err := os.Open("/proc")
	if err != nil {
		return table
	}
	names, _ := dir.Readdirnames(-1)
	dir.Close()
	buf := make([]byte, 1024)
	for _, name := range names {
		pid, err := strconv.Atoi(name)
		if err != nil {
			continue
		}
		if p, ok := readStat(pid, buf); ok {
			table[pid] = p
		}
	}
	return table
}

// readStat parses /proc/<pid>/stat: the fields after the command name's closing parenthesis.
func readStat(pid int, buf []byte) (proc, bool) {
	fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/stat", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return proc{}, false
	}
	n, err := unix.Read(fd, buf)
	unix.Close(fd)
	if err != nil || n <= 0 {
		return proc{}, false
	}
	raw := buf[:n]
	i := bytes.LastIndexByte(raw, ')')
	if i < 0 || i+2 >= len(raw) {
		return proc{}, false
	}
	fields := bytes.Fields(raw[i+2:])
	if len(fields) < 20 {
		return proc{}, false
	}
	ppid, _ := strconv.Atoi(string(fields[1]))
	pgid, _ := strconv.Atoi(string(fields[2]))
	threads, _ := strconv.Atoi(string(fields[17]))
	start, _ := strconv.ParseUint(string(fields[19]), 10, 64)
	return proc{ppid: ppid, pgid: pgid, state: fields[0][0], threads: threads, start: start}, true
}

type pidSet map[int]bool

func (s pidSet) sorted() []int {
	out := make([]int, 0, len(s))
	for p := range s {
		out = append(out, p)
	}
	sort.Ints(out)
	return out
}

// subtree is the live (not dead) descendants of root, not entering the subtrees rooted at skip.
func subtree(table procTable, root int, skip pidSet) pidSet {
	children := map[int][]int{}
	for p, info := range table {
		children[info.ppid] = append(children[info.ppid], p)
	}
	found := pidSet{}
	stack := []int{root}
	for len(stack) > 0 {
		top := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		for _, c := range children[top] {
			if !found[c] && !skip[c] {
				found[c] = true
				stack = append(stack, c)
			}
		}
	}
	for p := range found {
		if table[p].dead() {
			delete(found, p)
		}
	}
	return found
}

// under is the live descendants of every adopter, envd itself and the subtrees rooted at skip apart.
func under(table procTable, adopters []int, skip pidSet) pidSet {
	found := pidSet{}
	for _, root := range adopters {
		s := skip
		if root != self {
			s = pidSet{self: true}
			for p := range skip {
				s[p] = true
			}
		}
		for p := range subtree(table, root, s) {
			found[p] = true
		}
	}
	return found
}

// reapAdopted reaps envd's zombie children that no command waits for (orphans envd adopted as sub-reaper);
// table nil: read it now.
func reapAdopted(managed map[int]bool, table procTable) {
	if table == nil {
		table = readProcTable()
	}
	for pid, info := range table {
		if info.ppid == self && info.dead() && !managed[pid] {
			var ws unix.WaitStatus
			_, _ = unix.Wait4(pid, &ws, unix.WNOHANG, nil)
		}
	}
}

func signalAll(pids pidSet, sig unix.Signal) {
	for p := range pids {
		_ = unix.Kill(p, sig)
	}
}

// killSubtree kills every process under the adopters (envd alone when empty) except the subtrees rooted at skip;
// returns the survivors (none, normally). `managed` are the children their commands reap: killed like the rest
// but not reaped here.
func killSubtree(skip pidSet, managed map[int]bool, adopters []int) []int {
	roots := adopters
	if len(roots) == 0 {
		roots = []int{self}
	}
	table := readProcTable()
	stopped := pidSet{}
	for i := 0; i < stopRounds; i++ { // stop first: a stopped process forks no more
		doomed := pidSet{}
		for p := range under(table, roots, skip) {
			if !stopped[p] {
				doomed[p] = true
			}
		}
		if len(doomed) == 0 {
			break
		}
		signalAll(doomed, unix.SIGSTOP)
		for p := range doomed {
			stopped[p] = true
		}
		table = readProcTable()
	}
	if len(stopped) == 0 { // the common case: nothing was left behind; one scan of /proc in all
		reapAdopted(managed, table)
		return nil
	}
	for i := 0; i < killRounds; i++ {
		left := under(readProcTable(), roots, skip)
		if len(left) == 0 {
			break
		}
		signalAll(left, unix.SIGKILL)
		reapAdopted(managed, nil)
		time.Sleep(time.Millisecond)
	}
	reapAdopted(managed, nil)
	return under(readProcTable(), roots, skip).sorted()
}
