package main

// Resetting a sandbox in place between rollouts (envd/reset.py): kill every process but envd and init, wipe every
// writable place (SysV IPC objects and POSIX message queues too), restore the workspace from its seed, then verify.
// Anything left means the sandbox is not reused.
//
// The wipe and the seed's copy follow the calls Python makes (os.listdir, shutil.rmtree, shutil.copytree with
// symlinks=True, shutil.copy2 with follow_symlinks=False, in Python 3.11's code) one system call for one, in the
// same order: what is removed and copied, which failure is met first, and the texts that report it are the Python
// envd's. A link is followed exactly where Python follows it, and nowhere else.

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"sort"
	"strings"
	"syscall"
	"time"
	"unicode"
	"unicode/utf8"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	resetKillRounds = 50 // reset.py's KILL_ROUNDS (reaper.go's killRounds is kill_subtree's)
	mqueueDir       = "/dev/mqueue"
)

// /proc/sysvipc/<kind> lists the objects of the sandbox's IPC namespace; the second column is the id
var sysvKinds = []string{"shm", "sem", "msg"}

// resetResult is what resetSandbox reports: whether the sandbox is pristine again, and what was not.
type resetResult struct {
	ok        bool
	detail    string
	killed    int
	durationS float64
	// set where Python's reset_sandbox raised an OSError and stopped there (a place it could not list, say): the
	// Python envd then failed the call with FAILED_PRECONDITION "<file>: <strerror>", what toStatus makes of err.
	// detail carries the same text, with ok false.
	err error
}

// resetSandbox kills, wipes, restores and verifies (reset.py's reset_sandbox). `managed`: the running commands'
// pids, which their own goroutines reap; `modes`: the permission bits of the workspace and the socket when envd
// started, put back with their times and xattrs.
//
// Refused when envd runs as root: a sandbox's envd never does (it runs as the sandbox's user), and an envd started
// as root on a host would empty the host's /tmp and /dev/shm and kill what it can see.
func resetSandbox(workspace, socketDir, socketName, seed string, managed map[int]bool, modes map[string]uint32) resetResult {
	t0 := time.Now()
	if unix.Geteuid() == 0 {
		return resetResult{ok: false, detail: "envd runs as root, so this is no sandbox: reset refused"}
	}
	var problems []string
	killed, survivors := killAllOthers(managed)
	raised := func(e *pyOSError) resetResult {
		text := e.filename() + ": " + e.strerror()
		return resetResult{detail: text, killed: killed, durationS: time.Since(t0).Seconds(), err: e.pathError()}
	}
	if len(survivors) > 0 {
		problems = append(problems, "processes survived SIGKILL: "+reprIntList(survivors))
	}
	places := wipedPlaces(workspace, socketDir, socketName)
	// first: a place a rollout made unreadable is readable again
	restored, e := restoreInodes(modes, workspace, fsJoin(socketDir, socketName))
	problems = append(problems, restored...)
	if e != nil {
		return raised(e)
	}
	for _, pl := range places {
		failed, e := emptyDir(pl.path, pl.keep)
		if e != nil {
			return raised(e)
		}
		problems = append(problems, failed...)
	}
	failed, e := clearIPC()
	if e != nil {
		return raised(e)
	}
	problems = append(problems, failed...)
	if seed != "" {
		if err := copySeed(seed, workspace); err != nil {
			problems = append(problems, fmt.Sprintf("restoring the workspace from %s: %s", seed, err))
		}
	}
	// verify: nothing but the allowed entries is left anywhere writable
	for _, pl := range places {
		left, e := leftIn(pl, workspace, seed)
		if e != nil {
			return raised(e)
		}
		if len(left) > 0 {
			problems = append(problems, fmt.Sprintf("%s still holds %s", pl.path, pyReprList(atMost(left, 5))))
		}
	}
	ipc, e := ipcLeft()
	if e != nil {
		return raised(e)
	}
	if len(ipc) > 0 {
		problems = append(problems, "IPC objects survived: "+pyReprList(atMost(ipc, 5)))
	}
	if appeared := otherPids(nil); len(appeared) > 0 {
		problems = append(problems, "processes appeared during the reset: "+reprIntList(appeared))
	}
	return resetResult{
		ok: len(problems) == 0, detail: summary(problems), killed: killed,
		durationS: time.Since(t0).Seconds(),
	}
}

// maxProblems is what a reset tells of what it could not clean: a line a problem, the first maxProblems of them
// (envd/reset.py too). Each folder left in /tmp was a line: a rollout that left 240,000 it could not remove made
// every reset of its sandbox answer 64 MiB, which the worker read and logged.
const maxProblems = 10

// summary is the problems as the reset's detail: the first maxProblems, and how many more.
func summary(problems []string) string {
	shown := atMost(problems, maxProblems)
	if more := len(problems) - len(shown); more > 0 {
		shown = append(append([]string{}, shown...), fmt.Sprintf("and %d more", more))
	}
	return strings.Join(shown, "; ")
}

// --- processes ---

// otherPids is the live processes but init and envd, ascending as /proc lists them (a zombie is dead: it only
// waits for its parent to reap it); table nil: read it now.
func otherPids(table procTable) []int {
	if table == nil {
		table = readProcTable()
	}
	var pids []int
	for p, info := range table {
		if p != 1 && p != self && !info.dead() {
			pids = append(pids, p)
		}
	}
	sort.Ints(pids)
	return pids
}

// killAllOthers SIGKILLs every process except init and envd until none is left; returns (killed, survivors).
// envd reaps the orphans it adopted as sub-reaper; `managed` it leaves to their commands' goroutines.
func killAllOthers(managed map[int]bool) (int, []int) {
	killed := 0
	for i := 0; i < resetKillRounds; i++ {
		table := readProcTable()
		pids := otherPids(table)
		if len(pids) == 0 {
			reapAdopted(managed, table) // the same scan: one in all when nothing is left (the common case)
			return killed, nil
		}
		for _, pid := range pids {
			if unix.Kill(pid, unix.SIGKILL) == nil { // ESRCH, EPERM: not counted
				killed++
			}
		}
		time.Sleep(10 * time.Millisecond)
		reapAdopted(managed, nil)
	}
	return killed, otherPids(nil)
}

// --- the places ---

type wipedPlace struct {
	path string
	keep []string // names left in place: the socket in its directory
}

// wipedPlaces is reset.py's `places` dict: /tmp, /dev/shm, the workspace and the socket's directory, in that
// order; a place named twice (the socket in /tmp) is one entry, where it first came, with the last entry's keep.
func wipedPlaces(workspace, socketDir, socketName string) []wipedPlace {
	var places []wipedPlace
	add := func(path string, keep ...string) {
		for i := range places {
			if places[i].path == path {
				places[i].keep = keep
				return
			}
		}
		places = append(places, wipedPlace{path, keep})
	}
	add("/tmp")
	add("/dev/shm")
	add(workspace)
	add(socketDir, socketName)
	return places
}

// restoreInodes puts the wiped places' own inodes (and envd's socket) back as envd found them at its start: their
// permission bits, no user xattrs, and the reset's time as theirs. Emptied, a place still carried what a rollout set
// on the place itself (a chmod, `touch -d`, a `user.` xattr: 60-odd bits a rollout can read in the next). envd runs
// as the sandbox's user, so what a rollout could change, envd can put back; what envd may not touch, neither could
// it. The paths go in the order the Python envd noted them: the workspace, then the socket.
func restoreInodes(modes map[string]uint32, workspace, socketPath string) ([]string, *pyOSError) {
	paths := make([]string, 0, len(modes))
	for path := range modes {
		paths = append(paths, path)
	}
	rank := func(p string) int {
		switch p {
		case workspace:
			return 0
		case socketPath:
			return 1
		}
		return 2
	}
	sort.Slice(paths, func(i, j int) bool {
		ri, rj := rank(paths[i]), rank(paths[j])
		return ri < rj || ri == rj && paths[i] < paths[j]
	})
	var problems []string
	for _, path := range paths {
		mode := modes[path]
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err != nil {
			if err == unix.ENOENT {
				continue
			}
			return problems, newPyOSError(err, path)
		}
		if st.Mode&unix.S_IFMT == unix.S_IFLNK {
			problems = append(problems, path+" was replaced by a link")
			continue
		}
		// one suppress(PermissionError) in Python: a refused chmod skips the utime as well
		var err error
		if st.Mode&0o7777 != mode {
			err = unix.Chmod(path, mode)
		}
		if err == nil {
			err = unix.UtimesNanoAt(unix.AT_FDCWD, path, nil, 0) // now
		}
		if err != nil && !isPermissionError(err) {
			return problems, newPyOSError(err, path)
		}
		// any other error (ENOTSUP: a filesystem without xattrs has none to clear) ends the clearing
		if names, err := shListxattr(path, false); err == nil {
			for _, name := range names {
				if strings.HasPrefix(name, "user.") {
					if err := unix.Lremovexattr(path, name); err != nil && !isPermissionError(err) {
						break
					}
				}
			}
		}
		if err := unix.Lstat(path, &st); err != nil {
			return problems, newPyOSError(err, path)
		}
		if st.Mode&0o7777 != mode {
			problems = append(problems, fmt.Sprintf("%s: mode %o, not %o", path, st.Mode&0o7777, mode))
		}
		if names, err := shListxattr(path, false); err == nil {
			for _, name := range names {
				if strings.HasPrefix(name, "user.") {
					problems = append(problems, path+" keeps user xattrs")
					break
				}
			}
		}
	}
	return problems, nil
}

// emptyDir removes everything inside `path` but the names in keep (links removed, never followed); returns what
// could not be removed. A place that does not exist is empty; one that cannot be listed stops the reset.
func emptyDir(path string, keep []string) ([]string, *pyOSError) {
	names, e := shListdir(path)
	if e != nil {
		if e.errno == unix.ENOENT {
			return nil, nil
		}
		return nil, e
	}
	var failed []string
	for _, name := range names {
		if hasName(keep, name) {
			continue
		}
		full := fsJoin(path, name)
		var st unix.Stat_t
		var err *pyOSError
		if lerr := unix.Lstat(full, &st); lerr != nil {
			err = newPyOSError(lerr, full)
		} else if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			err = shRmtree(full)
		} else if uerr := unix.Unlink(full); uerr != nil {
			err = newPyOSError(uerr, full)
		}
		if err != nil {
			failed = append(failed, full+": "+err.strerror())
		}
	}
	return failed, nil
}

// leftIn is what the verification finds in a place: its names but the kept ones (and, in the workspace, the
// seed's), sorted as Python sorts str. A place, or seed, that is gone holds nothing to report.
func leftIn(pl wipedPlace, workspace, seed string) ([]string, *pyOSError) {
	names, e := shListdir(pl.path)
	if e == nil && pl.path == workspace && seed != "" {
		var seeded []string
		if seeded, e = shListdir(seed); e == nil {
			keep := append(append([]string{}, pl.keep...), seeded...)
			pl.keep = keep
		}
	}
	if e != nil {
		if e.errno == unix.ENOENT {
			return nil, nil
		}
		return nil, e
	}
	var left []string
	for _, name := range names {
		if !hasName(pl.keep, name) {
			left = append(left, name)
		}
	}
	sortByCodePoint(left)
	return left, nil
}

// --- IPC (envd/kernel.py's sysv_ids and remove_sysv) ---

// clearIPC removes every SysV IPC object and POSIX message queue; returns what could not be removed.
func clearIPC() ([]string, *pyOSError) {
	var failed []string
	for _, kind := range sysvKinds {
		ids, e := sysvIDs(kind)
		if e != nil {
			return nil, e
		}
		for _, id := range ids {
			if errno := removeSysv(kind, id); errno != 0 {
				// str(OSError(errno, text)), as kernel.py raises it
				failed = append(failed, fmt.Sprintf("[Errno %d] removing SysV %s %d: %s", int(errno), kind, id, strerror(errno)))
			}
		}
	}
	more, e := emptyDir(mqueueDir, nil)
	if e != nil {
		return nil, e
	}
	return append(failed, more...), nil
}

func ipcLeft() ([]string, *pyOSError) {
	var left []string
	for _, kind := range sysvKinds {
		ids, e := sysvIDs(kind)
		if e != nil {
			return nil, e
		}
		for _, id := range ids {
			left = append(left, fmt.Sprintf("SysV %s %d", kind, id))
		}
	}
	names, e := shListdir(mqueueDir)
	if e != nil && e.errno != unix.ENOENT {
		return nil, e
	}
	for _, name := range names {
		left = append(left, "message queue "+name)
	}
	return left, nil
}

// sysvIDs is the ids of the SysV IPC objects of one kind ("shm", "sem", "msg") in this IPC namespace; none where
// the kernel has no /proc/sysvipc.
func sysvIDs(kind string) ([]int, *pyOSError) {
	path := "/proc/sysvipc/" + kind
	data, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, nil
		}
		return nil, newPyOSError(err, path)
	}
	lines := strings.Split(string(data), "\n")
	var ids []int
	for i, line := range lines {
		fields := strings.Fields(line)
		if i == 0 || len(fields) < 2 { // the header
			continue
		}
		var id int
		if _, err := fmt.Sscan(fields[1], &id); err == nil {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// removeSysv removes one SysV IPC object (IPC_RMID); a shared memory segment goes once its last user detaches.
func removeSysv(kind string, id int) syscall.Errno {
	var errno syscall.Errno
	switch kind {
	case "shm":
		_, _, errno = unix.Syscall(unix.SYS_SHMCTL, uintptr(id), unix.IPC_RMID, 0)
	case "sem":
		_, _, errno = unix.Syscall6(unix.SYS_SEMCTL, uintptr(id), 0, unix.IPC_RMID, 0, 0, 0)
	default:
		_, _, errno = unix.Syscall(unix.SYS_MSGCTL, uintptr(id), unix.IPC_RMID, 0)
	}
	return errno
}

// --- shutil.rmtree (Python 3.11's fd-based walk) ---

// shRmtree removes a directory tree without following a link, stopping at the first failure (rmtree without
// onerror raises it). A directory swapped for something else between its lstat and its open is refused with
// Python's message, whose strerror is None.
func shRmtree(path string) *pyOSError {
	var orig, st unix.Stat_t
	if err := unix.Lstat(path, &orig); err != nil {
		return newPyOSError(err, path)
	}
	// O_NONBLOCK, which Python does not pass: a directory swapped for a FIFO fails the samestat check below
	// instead of blocking the reset
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return newPyOSError(err, path)
	}
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return newPyOSError(err)
	}
	if !sameInode(&orig, &st) {
		unix.Close(fd)
		return &pyOSError{msg: "Cannot call rmtree on a symbolic link"}
	}
	if e := shRmtreeFd(fd, path); e != nil {
		unix.Close(fd)
		return e
	}
	unix.Close(fd)
	if err := unix.Rmdir(path); err != nil {
		return newPyOSError(err, path)
	}
	return nil
}

// shRmtreeFd empties the directory open as topfd (shutil's _rmtree_safe_fd): entries in the kernel's order,
// directories by fd relative to their parent's.
func shRmtreeFd(topfd int, path string) *pyOSError {
	entries, err := shGetdents(topfd)
	if err != nil {
		return newPyOSError(err, path)
	}
	for _, ent := range entries {
		fullname := fsJoin(path, ent.name)
		var orig unix.Stat_t
		isDir := ent.typ == unix.DT_DIR
		if ent.typ == unix.DT_UNKNOWN { // DirEntry.is_dir(follow_symlinks=False) asks lstat, an error reads false
			isDir = unix.Fstatat(topfd, ent.name, &orig, unix.AT_SYMLINK_NOFOLLOW) == nil &&
				orig.Mode&unix.S_IFMT == unix.S_IFDIR
		}
		if isDir {
			if err := unix.Fstatat(topfd, ent.name, &orig, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return newPyOSError(err, fullname)
			}
			isDir = orig.Mode&unix.S_IFMT == unix.S_IFDIR
		}
		if !isDir {
			if err := unix.Unlinkat(topfd, ent.name, 0); err != nil {
				return newPyOSError(err, fullname)
			}
			continue
		}
		dirfd, err := unix.Openat(topfd, ent.name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return newPyOSError(err, fullname)
		}
		var st unix.Stat_t
		if err := unix.Fstat(dirfd, &st); err != nil {
			unix.Close(dirfd)
			return newPyOSError(err)
		}
		if !sameInode(&orig, &st) { // replaced by a link after the lstat
			unix.Close(dirfd)
			return &pyOSError{msg: "Cannot call rmtree on a symbolic link"}
		}
		if e := shRmtreeFd(dirfd, fullname); e != nil {
			unix.Close(dirfd)
			return e
		}
		unix.Close(dirfd)
		if err := unix.Unlinkat(topfd, ent.name, unix.AT_REMOVEDIR); err != nil {
			return newPyOSError(err, fullname)
		}
	}
	return nil
}

func sameInode(a, b *unix.Stat_t) bool { return a.Dev == b.Dev && a.Ino == b.Ino }

// --- the seed: shutil.copytree(symlinks=True) and shutil.copy2(follow_symlinks=False) ---

// copySeed copies the seed's entries into the workspace (reset.py's _copy_seed): a directory (not a link to one)
// with copytree, keeping links as links, anything else with copy2, a link as a link; the first failure stops it.
func copySeed(seed, workspace string) error {
	names, e := shListdir(seed)
	if e != nil {
		return e
	}
	for _, name := range names {
		src, dst := fsJoin(seed, name), fsJoin(workspace, name)
		var st unix.Stat_t
		var err error
		if unix.Stat(src, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR && !shIsLink(src) {
			err = shCopytree(src, dst)
		} else {
			err = shCopy2(src, dst, false)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// copyFailure is one (src, dst, str(error)) of a shutil.Error.
type copyFailure struct{ src, dst, why string }

// copyErrors is shutil.Error: copytree copies what it can and raises the failures at the end, as one list.
type copyErrors []copyFailure

// Error is str(shutil.Error(list)): the list's repr.
func (c copyErrors) Error() string {
	parts := make([]string, len(c))
	for i, f := range c {
		parts[i] = "(" + pyRepr(f.src) + ", " + pyRepr(f.dst) + ", " + pyRepr(f.why) + ")"
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

// shCopytree is shutil.copytree(src, dst, symlinks=True): dst is made (and must not exist), links are made as links,
// directories copied by copytree, the rest by copy2; then src's times, xattrs and mode go on dst.
func shCopytree(src, dst string) error {
	entries, e := shScandir(src)
	if e != nil {
		return e
	}
	if e := shMakedirs(dst); e != nil {
		return e
	}
	var failures copyErrors
	for _, ent := range entries {
		srcname, dstname := fsJoin(src, ent.name), fsJoin(dst, ent.name)
		var err error
		if ent.isLink() {
			// (a nil *pyOSError must not become a non-nil error)
			if target, e := shReadlink(srcname); e != nil {
				err = e
			} else if serr := unix.Symlink(target, dstname); serr != nil {
				err = newPyOSError(serr, target, dstname)
			} else {
				err = shCopystat(srcname, dstname, false)
			}
		} else if ent.isDir() {
			err = shCopytree(srcname, dstname)
		} else {
			err = shCopy2(srcname, dstname, true)
		}
		var nested copyErrors
		if errors.As(err, &nested) {
			failures = append(failures, nested...)
		} else if err != nil {
			failures = append(failures, copyFailure{srcname, dstname, err.Error()})
		}
	}
	if err := shCopystat(src, dst, true); err != nil {
		failures = append(failures, copyFailure{src, dst, err.Error()})
	}
	if len(failures) > 0 {
		return failures
	}
	return nil
}

// shCopy2 is shutil.copy2: the contents (a link's target, when not following, becomes a new link) and then the
// metadata; dst an existing directory (or link to one) means dst/<src's name>.
func shCopy2(src, dst string, followSymlinks bool) error {
	if shIsDir(dst) {
		dst = fsJoin(dst, src[strings.LastIndexByte(src, '/')+1:])
	}
	if err := shCopyfile(src, dst, followSymlinks); err != nil {
		return err
	}
	return shCopystat(src, dst, followSymlinks)
}

// shCopyfile is shutil.copyfile: refused for the same file and for a FIFO (both looked at through links, as Python
// does), a link copied as a link when not following, else the bytes by sendfile, or read and write where sendfile
// gives up at once.
func shCopyfile(src, dst string, followSymlinks bool) error {
	var s, d unix.Stat_t
	srcErr, dstErr := unix.Stat(src, &s), unix.Stat(dst, &d)
	if srcErr == nil && dstErr == nil && sameInode(&s, &d) {
		return &pyOSError{msg: fmt.Sprintf("%s and %s are the same file", pyRepr(src), pyRepr(dst))}
	}
	if srcErr == nil && s.Mode&unix.S_IFMT == unix.S_IFIFO {
		return &pyOSError{msg: fmt.Sprintf("`%s` is a named pipe", src)}
	}
	if dstErr == nil && d.Mode&unix.S_IFMT == unix.S_IFIFO {
		return &pyOSError{msg: fmt.Sprintf("`%s` is a named pipe", dst)}
	}
	if !followSymlinks && shIsLink(src) {
		target, err := shReadlink(src)
		if err != nil {
			return err
		}
		if err := unix.Symlink(target, dst); err != nil {
			return newPyOSError(err, target, dst)
		}
		return nil
	}
	in, err := unix.Open(src, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return newPyOSError(err, src)
	}
	defer unix.Close(in)
	out, err := unix.Open(dst, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_CLOEXEC, 0o666)
	if err != nil {
		return newPyOSError(err, dst)
	}
	if err := shCopyBytes(in, out, src, dst); err != nil {
		unix.Close(out)
		return err
	}
	if err := unix.Close(out); err != nil {
		return newPyOSError(err)
	}
	return nil
}

// shCopyBytes is shutil's _fastcopy_sendfile with copyfileobj behind it: sendfile's errors name both files;
// sendfile failing before a byte was written falls back to read and write, whose errors name none.
func shCopyBytes(in, out int, src, dst string) error {
	blocksize := 1 << 27 // 128 MiB where fstat fails
	var st unix.Stat_t
	if unix.Fstat(in, &st) == nil {
		blocksize = 1 << 23 // 8 MiB at least
		if st.Size > int64(blocksize) {
			blocksize = int(st.Size)
		}
	}
	if unsafe.Sizeof(uintptr(0)) < 8 && blocksize > 1<<30 {
		blocksize = 1 << 30
	}
	var offset int64
	for {
		n, err := unix.Sendfile(out, in, &offset, blocksize)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			if err == unix.ENOSPC {
				return newPyOSError(err, src, dst)
			}
			if pos, serr := unix.Seek(out, 0, 1); err == unix.ENOTSOCK || offset == 0 && serr == nil && pos == 0 {
				return shReadWrite(in, out)
			}
			return newPyOSError(err, src, dst)
		}
		if n == 0 {
			return nil
		}
	}
}

// shReadWrite is shutil.copyfileobj over the open files, 64 KiB at a time.
func shReadWrite(in, out int) error {
	buf := make([]byte, 64<<10)
	for {
		n, err := unix.Read(in, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return newPyOSError(err)
		}
		if n <= 0 {
			return nil
		}
		for b := buf[:n]; len(b) > 0; {
			w, err := unix.Write(out, b)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				return newPyOSError(err)
			}
			b = b[w:]
		}
	}
}

// shCopystat is shutil.copystat: src's access and modification times, its xattrs (before the mode, which may make
// dst read-only) and its permission bits onto dst. Through links unless followSymlinks is false and both are
// links; a link's mode cannot be set on Linux, and is left.
func shCopystat(src, dst string, followSymlinks bool) error {
	follow := followSymlinks || !(shIsLink(src) && shIsLink(dst))
	var st unix.Stat_t
	var err error
	flags := 0
	if follow {
		err = unix.Stat(src, &st)
	} else {
		err = unix.Lstat(src, &st)
		flags = unix.AT_SYMLINK_NOFOLLOW
	}
	if err != nil {
		return newPyOSError(err, src)
	}
	times := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, dst, times, flags); err != nil {
		return newPyOSError(err, dst)
	}
	if err := shCopyxattr(src, dst, follow); err != nil {
		return err
	}
	if follow {
		if err := unix.Chmod(dst, st.Mode&0o7777); err != nil {
			return newPyOSError(err, dst)
		}
	}
	return nil
}

// shCopyxattr is shutil._copyxattr: every xattr of src onto dst; what the filesystem or the user may not have or
// set is skipped.
func shCopyxattr(src, dst string, follow bool) error {
	names, err := shListxattr(src, follow)
	if err != nil {
		if err == unix.ENOTSUP || err == unix.ENODATA || err == unix.EINVAL {
			return nil
		}
		return newPyOSError(err, src)
	}
	for _, name := range names {
		var e *pyOSError
		value, err := shGetxattr(src, name, follow)
		if err != nil {
			e = newPyOSError(err, src)
		} else {
			set := unix.Lsetxattr
			if follow {
				set = unix.Setxattr
			}
			if err := set(dst, name, value, 0); err != nil {
				e = newPyOSError(err, dst)
			}
		}
		if e != nil {
			switch e.errno {
			case unix.EPERM, unix.ENOTSUP, unix.ENODATA, unix.EINVAL, unix.EACCES:
			default:
				return e
			}
		}
	}
	return nil
}

// shMakedirs is os.makedirs(name) (exist_ok false): the missing parents too, name itself must not exist.
func shMakedirs(name string) *pyOSError {
	head, tail := fsDirname(name), fsBasename(name)
	if tail == "" {
		head, tail = fsDirname(head), fsBasename(head)
	}
	if head != "" && tail != "" && !shExists(head) {
		if e := shMakedirs(head); e != nil && e.errno != unix.EEXIST {
			return e
		}
		if tail == "." {
			return nil
		}
	}
	if err := unix.Mkdir(name, 0o777); err != nil {
		return newPyOSError(err, name)
	}
	return nil
}

// --- directories, links, xattrs ---

type shDirEntry struct {
	name string
	typ  uint8 // d_type: DT_UNKNOWN where the filesystem does not say
	path string
}

// isLink is DirEntry.is_symlink(): d_type, or lstat where it is unknown.
func (d shDirEntry) isLink() bool {
	if d.typ != unix.DT_UNKNOWN {
		return d.typ == unix.DT_LNK
	}
	return shIsLink(d.path)
}

// isDir is DirEntry.is_dir(): d_type, or stat (through a link) where it is unknown.
func (d shDirEntry) isDir() bool {
	if d.typ != unix.DT_UNKNOWN && d.typ != unix.DT_LNK {
		return d.typ == unix.DT_DIR
	}
	return shIsDir(d.path)
}

// shListdir is os.listdir: the names in the kernel's order, "." and ".." apart.
func shListdir(path string) ([]string, *pyOSError) {
	entries, e := shScandir(path)
	if e != nil {
		return nil, e
	}
	names := make([]string, len(entries))
	for i, ent := range entries {
		names[i] = ent.name
	}
	return names, nil
}

// shScandir is os.scandir(path) read whole: opendir's flags (through a link), the kernel's order.
func shScandir(path string) ([]shDirEntry, *pyOSError) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, newPyOSError(err, path)
	}
	defer unix.Close(fd)
	entries, err := shGetdents(fd)
	if err != nil {
		return nil, newPyOSError(err, path)
	}
	for i := range entries {
		entries[i].path = fsJoin(path, entries[i].name)
	}
	return entries, nil
}

// shGetdents reads an open directory with getdents64, "." and ".." apart.
func shGetdents(fd int) ([]shDirEntry, error) {
	var out []shDirEntry
	var d unix.Dirent
	reclenAt, typeAt, nameAt := int(unsafe.Offsetof(d.Reclen)), int(unsafe.Offsetof(d.Type)), int(unsafe.Offsetof(d.Name))
	buf := make([]byte, 32<<10)
	for {
		n, err := unix.Getdents(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return out, nil
		}
		for b := buf[:n]; len(b) > nameAt; {
			reclen := int(*(*uint16)(unsafe.Pointer(&b[reclenAt])))
			if reclen <= nameAt || reclen > len(b) {
				break
			}
			name := b[nameAt:reclen]
			if i := bytes.IndexByte(name, 0); i >= 0 {
				name = name[:i]
			}
			if s := string(name); s != "." && s != ".." {
				out = append(out, shDirEntry{name: s, typ: b[typeAt]})
			}
			b = b[reclen:]
		}
	}
}

func shReadlink(path string) (string, *pyOSError) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlink(path, buf)
		if err != nil {
			return "", newPyOSError(err, path)
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
}

// shListxattr is os.listxattr(path, follow_symlinks=follow); the error is the bare errno.
func shListxattr(path string, follow bool) ([]string, error) {
	list := unix.Llistxattr
	if follow {
		list = unix.Listxattr
	}
	for {
		size, err := list(path, nil)
		if err != nil || size == 0 {
			return nil, err
		}
		buf := make([]byte, size)
		n, err := list(path, buf)
		if err == unix.ERANGE { // grew in between
			continue
		}
		if err != nil {
			return nil, err
		}
		var names []string
		for _, name := range strings.Split(string(buf[:n]), "\x00") {
			if name != "" {
				names = append(names, name)
			}
		}
		return names, nil
	}
}

// shGetxattr is os.getxattr(path, name, follow_symlinks=follow); the error is the bare errno.
func shGetxattr(path, name string, follow bool) ([]byte, error) {
	get := unix.Lgetxattr
	if follow {
		get = unix.Getxattr
	}
	for {
		size, err := get(path, name, nil)
		if err != nil || size == 0 {
			return []byte{}, err
		}
		buf := make([]byte, size)
		n, err := get(path, name, buf)
		if err == unix.ERANGE {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

func shIsLink(path string) bool {
	var st unix.Stat_t
	return unix.Lstat(path, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK
}

func shIsDir(path string) bool {
	var st unix.Stat_t
	return unix.Stat(path, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR
}

func shExists(path string) bool {
	var st unix.Stat_t
	return unix.Stat(path, &st) == nil
}

func isPermissionError(err error) bool { return err == unix.EPERM || err == unix.EACCES }

func hasName(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func atMost(list []string, n int) []string {
	if len(list) > n {
		return list[:n]
	}
	return list
}

// --- Python's paths, errors and reprs, so the texts read as the Python envd's ---

// pyOSError is a Python OSError: an errno and the file name(s) it is about, or (errno 0) only a message, as
// shutil's "Cannot call rmtree on a symbolic link" or "`x` is a named pipe".
type pyOSError struct {
	errno syscall.Errno
	msg   string
	files []string // filename, filename2
}

func newPyOSError(err error, files ...string) *pyOSError {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return &pyOSError{msg: err.Error()}
	}
	return &pyOSError{errno: errno, files: files}
}

// Error is str(e): "[Errno 13] Permission denied: '/a'", "[Errno 17] File exists: 'target' -> '/a'", the message.
func (e *pyOSError) Error() string {
	if e.errno == 0 {
		return e.msg
	}
	s := fmt.Sprintf("[Errno %d] %s", int(e.errno), strerror(e.errno))
	switch len(e.files) {
	case 1:
		s += ": " + pyRepr(e.files[0])
	case 2:
		s += ": " + pyRepr(e.files[0]) + " -> " + pyRepr(e.files[1])
	}
	return s
}

// strerror is e.strerror: None for an OSError raised with a message only.
func (e *pyOSError) strerror() string {
	if e.errno == 0 {
		return "None"
	}
	return strerror(e.errno)
}

func (e *pyOSError) filename() string {
	if len(e.files) == 0 {
		return ""
	}
	return e.files[0]
}

// pathError is the error whose gRPC status (toStatus) is the Python envd's for this OSError leaving a call.
func (e *pyOSError) pathError() error {
	if e.errno == 0 {
		return internalf("%s", e.msg)
	}
	return &fs.PathError{Op: "reset", Path: e.filename(), Err: e.errno}
}

// pyCodePoints is the code points Python decodes a file name to: UTF-8, a byte that is not part of it as the
// surrogate U+DC80-U+DCFF (surrogateescape). Negative for those, so no valid rune can be mistaken for them.
func pyCodePoints(s string) []rune {
	out := make([]rune, 0, len(s))
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			r = -(0xDC00 + rune(s[i]))
		}
		out = append(out, r)
		i += size
	}
	return out
}

// sortByCodePoint sorts names as Python sorts str: by code point, surrogate-escaped bytes where they fall.
func sortByCodePoint(names []string) {
	cp := func(r rune) rune {
		if r < 0 {
			return -r
		}
		return r
	}
	sort.Slice(names, func(i, j int) bool {
		a, b := pyCodePoints(names[i]), pyCodePoints(names[j])
		for k := 0; k < len(a) && k < len(b); k++ {
			if ca, cb := cp(a[k]), cp(b[k]); ca != cb {
				return ca < cb
			}
		}
		return len(a) < len(b)
	})
}

// pyRepr is repr(str): quoted as Python chooses, escaped as Python escapes (control characters, what is not
// printable, a surrogate-escaped byte as \udcXX).
func pyRepr(s string) string {
	quote := byte('\'')
	if strings.IndexByte(s, '\'') >= 0 && strings.IndexByte(s, '"') < 0 {
		quote = '"'
	}
	var b strings.Builder
	b.WriteByte(quote)
	for _, r := range pyCodePoints(s) {
		switch {
		case r < 0:
			fmt.Fprintf(&b, "\\u%04x", -r)
		case r == rune(quote) || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, "\\x%02x", r)
		case r < 0x7f || unicode.IsPrint(r):
			b.WriteRune(r)
		case r <= 0xff:
			fmt.Fprintf(&b, "\\x%02x", r)
		case r <= 0xffff:
			fmt.Fprintf(&b, "\\u%04x", r)
		default:
			fmt.Fprintf(&b, "\\U%08x", r)
		}
	}
	b.WriteByte(quote)
	return b.String()
}

// pyReprList is repr(list of str).
func pyReprList(list []string) string {
	parts := make([]string, len(list))
	for i, s := range list {
		parts[i] = pyRepr(s)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

// reprIntList is repr(list of int): "[12, 34]".
func reprIntList(list []int) string {
	parts := make([]string, len(list))
	for i, n := range list {
		parts[i] = fmt.Sprint(n)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}
