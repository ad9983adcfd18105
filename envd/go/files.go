package main

import (
	"context"
	"io"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	pb "envfleet/envdpb"
)

// filesystemServer: file operations that never follow symbolic links (envd/files.py, and FilesystemService in
// envd/server.py). Every path is checked component by component as files.py checks it, so the answers and their
// messages are the Python envd's; the operations themselves then go through directory fds opened one component at a
// time with O_NOFOLLOW, so a component swapped for a link after the check is not followed either.
type filesystemServer struct {
	pb.UnimplementedFilesystemServer
	cfg *Config
}

func newFilesystemServer(cfg *Config) *filesystemServer { return &filesystemServer{cfg: cfg} }

func (s *filesystemServer) ReadFile(ctx context.Context, req *pb.ReadFileRequest) (*pb.ReadFileResponse, error) {
	if req.MaxBytes < 0 {
		return nil, invalidf("max_bytes must be >= 0, got %d", req.MaxBytes)
	}
	limit := req.MaxBytes
	if limit == 0 {
		limit = s.cfg.DefaultReadBytes
	}
	if limit > maxMessageBytes-4096 {
		limit = maxMessageBytes - 4096
	}
	data, truncated, err := fsReadFile(req.Path, s.cfg.Workspace, limit)
	if err != nil {
		return nil, err
	}
	return &pb.ReadFileResponse{Content: data, Truncated: truncated}, nil
}

func (s *filesystemServer) WriteFile(ctx context.Context, req *pb.WriteFileRequest) (*pb.WriteFileResponse, error) {
	mode := req.Mode
	if mode == 0 {
		mode = 0o644
	}
	if mode > 0o7777 {
		return nil, invalidf("mode 0o%o is not a permission mode", mode)
	}
	if err := fsWriteFile(req.Path, s.cfg.Workspace, req.Content, mode, req.MakeParents); err != nil {
		return nil, err
	}
	return &pb.WriteFileResponse{}, nil
}

func (s *filesystemServer) ListDir(ctx context.Context, req *pb.ListDirRequest) (*pb.ListDirResponse, error) {
	entries, err := fsListDir(req.Path, s.cfg.Workspace)
	if err != nil {
		return nil, err
	}
	return &pb.ListDirResponse{Entries: entries}, nil
}

func (s *filesystemServer) Stat(ctx context.Context, req *pb.StatRequest) (*pb.FileInfo, error) {
	return fsStat(req.Path, s.cfg.Workspace)
}

// Upload spools the whole stream (memory up to spoolBytes, then an unlinked temporary file), then extracts it:
// like the Python envd, nothing is written before the upload is complete.
func (s *filesystemServer) Upload(stream pb.Filesystem_UploadServer) error {
	first, err := stream.Recv()
	if err != nil && err != io.EOF {
		return err
	}
	if _, ok := first.GetChunk().(*pb.UploadChunk_DestDir); err == io.EOF || !ok || first.GetDestDir() == "" {
		return invalidf("the first upload chunk must name dest_dir")
	}
	spool := newFsSpool()
	defer spool.Close()
	for {
		chunk, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		if _, err := spool.Write(chunk.GetData()); err != nil {
			return err
		}
	}
	if err := spool.Rewind(); err != nil {
		return err
	}
	count, err := fsExtractTar(spool, first.GetDestDir(), s.cfg.Workspace)
	if err != nil {
		return err
	}
	return stream.SendAndClose(&pb.UploadResponse{Files: int32(count)})
}

// Download builds the whole archive first (spooled), so an error comes before any data, then streams it in
// chunkBytes pieces.
func (s *filesystemServer) Download(req *pb.DownloadRequest, stream pb.Filesystem_DownloadServer) error {
	if req.MaxBytes < 0 {
		return invalidf("max_bytes must be >= 0 (0: no cap), got %d", req.MaxBytes)
	}
	spool, err := fsBuildTar(req.Path, s.cfg.Workspace, req.MaxBytes)
	if err != nil {
		return err
	}
	defer spool.Close()
	buf := make([]byte, chunkBytes)
	for {
		n, err := io.ReadFull(spool, buf)
		if n > 0 {
			// Send has marshalled the message when it returns: buf can be reused
			if err := stream.Send(&pb.DataChunk{Data: buf[:n]}); err != nil {
				return err
			}
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// --- paths, spelled as Python's posixpath spells them: messages and FileInfo.path carry them ---

// fsNormpath is posixpath.normpath: "." for nothing, "." and empty components dropped, ".." taking one off (none
// above the root), and two leading slashes (exactly two) kept as POSIX allows.
func fsNormpath(p string) string {
	if p == "" {
		return "."
	}
	initial := 0
	if strings.HasPrefix(p, "/") {
		initial = 1
		if strings.HasPrefix(p, "//") && !strings.HasPrefix(p, "///") {
			initial = 2
		}
	}
	var comps []string
	for _, c := range strings.Split(p, "/") {
		if c == "" || c == "." {
			continue
		}
		if c != ".." || (initial == 0 && len(comps) == 0) || (len(comps) > 0 && comps[len(comps)-1] == "..") {
			comps = append(comps, c)
		} else if len(comps) > 0 {
			comps = comps[:len(comps)-1]
		}
	}
	out := strings.Repeat("/", initial) + strings.Join(comps, "/")
	if out == "" {
		return "."
	}
	return out
}

// fsJoin is posixpath.join of two: b where it is absolute, else b after a and one slash (none after a slash).
func fsJoin(a, b string) string {
	switch {
	case strings.HasPrefix(b, "/"):
		return b
	case a == "" || strings.HasSuffix(a, "/"):
		return a + b
	default:
		return a + "/" + b
	}
}

// fsDirname is posixpath.dirname: everything before the last slash, trailing slashes off unless it is all slashes.
func fsDirname(p string) string {
	head := p[:strings.LastIndexByte(p, '/')+1]
	if head != "" && strings.Trim(head, "/") != "" {
		head = strings.TrimRight(head, "/")
	}
	return head
}

// fsBasename is posixpath.basename: everything after the last slash.
func fsBasename(p string) string { return p[strings.LastIndexByte(p, '/')+1:] }

// fsSplit is where an absolute path's last component lives and its name there; the root is "." in itself.
func fsSplit(full string) (dir, name string) {
	dir, name = fsDirname(full), fsBasename(full)
	if name == "" {
		name = "."
	}
	return dir, name
}

// fsResolve is files.py's resolve: `path` made absolute against the workspace and normalized, each existing
// component lstat'ed, a symbolic link anywhere on the way refused (the last component too unless finalMayBeLink).
// Where a component does not exist the rest is not looked at: the caller decides whether that is an error.
func fsResolve(path, workspace string, finalMayBeLink bool) (string, error) {
	if path == "" {
		return "", invalidf("path is empty")
	}
	if strings.IndexByte(path, 0) >= 0 {
		return "", invalidf("path contains a NUL byte")
	}
	full := fsNormpath(fsJoin(workspace, path))
	parts := strings.Split(full, "/")[1:]
	prefix := ""
	for i, part := range parts {
		if part == "" {
			continue
		}
		prefix += "/" + part
		var st unix.Stat_t
		if err := unix.Lstat(prefix, &st); err == unix.ENOENT {
			return full, nil
		} else if err != nil {
			return "", &fs.PathError{Op: "lstat", Path: prefix, Err: err}
		}
		if st.Mode&unix.S_IFMT == unix.S_IFLNK && !(i == len(parts)-1 && finalMayBeLink) {
			target, err := fsReadlinkat(unix.AT_FDCWD, prefix)
			if err != nil {
				return "", &fs.PathError{Op: "readlink", Path: prefix, Err: err}
			}
			return "", symlinkf("%s: %s is a symbolic link (-> %s); envd does not follow links", path, prefix, target)
		}
	}
	return full, nil
}

// pathMax is Linux's PATH_MAX: a path-based call fails on a longer path (ENAMETOOLONG), where a walk from fd to fd
// would not; the walks check it so that they fail where the Python envd's calls by path fail.
const pathMax = 4096

func fsTooLong(path string) bool { return len(path) >= pathMax }

// fsWalkFlags opens the directories walked through: O_PATH, so that a directory needs no read permission to be
// walked (as for a call by path), or O_RDONLY where the kernel has no O_PATH (an old gVisor).
var fsWalkFlags = func() int {
	fd, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return unix.O_RDONLY
	}
	unix.Close(fd)
	return unix.O_PATH
}()

// fsOpenDir opens a directory by its absolute path one component at a time, each with O_NOFOLLOW: a link met on
// the way fails the open (ELOOP or ENOTDIR) where a path-based call would follow it. The fd is for *at calls.
func fsOpenDir(dir string) (int, error) {
	if fsTooLong(dir) {
		return -1, unix.ENAMETOOLONG
	}
	fd, err := unix.Open("/", fsWalkFlags|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	for _, part := range strings.Split(dir, "/") {
		if part == "" {
			continue
		}
		next, err := unix.Openat(fd, part, fsWalkFlags|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return -1, err
		}
		fd = next
	}
	return fd, nil
}

// fsOpenAt opens an absolute path's last component, never following a link, with the directory it lives in.
func fsOpenAt(full string, flags int, mode uint32) (int, error) {
	if fsTooLong(full) {
		return -1, unix.ENAMETOOLONG
	}
	dir, name := fsSplit(full)
	dirfd, err := fsOpenDir(dir)
	if err != nil {
		return -1, err
	}
	defer unix.Close(dirfd)
	return retryEINTR(func() (int, error) {
		return unix.Openat(dirfd, name, flags|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
	})
}

// retryEINTR calls an open again while a signal interrupts it (opening a FIFO or a device can block).
func retryEINTR(open func() (int, error)) (int, error) {
	for {
		fd, err := open()
		if err != unix.EINTR {
			return fd, err
		}
	}
}

// fsReadlinkat is readlinkat(2) with a buffer as large as the target needs.
func fsReadlinkat(dirfd int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
}

// fsLstatAt is fstatat(dirfd, name, AT_SYMLINK_NOFOLLOW).
func fsLstatAt(dirfd int, name string, st *unix.Stat_t) error {
	return unix.Fstatat(dirfd, name, st, unix.AT_SYMLINK_NOFOLLOW)
}

// fsMakeDirs is files.py's _make_dirs: every component of `full` made a directory where missing (0755 less the
// umask), a link or a non-directory on the way refused. It returns an fd of `full` for *at calls, which the caller closes.
func fsMakeDirs(full, shown string) (int, error) {
	fd, err := unix.Open("/", fsWalkFlags|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	prefix := ""
	for _, part := range strings.Split(full, "/")[1:] {
		prefix += "/" + part
		if part == "" {
			continue // the root itself ("/" or the empty component of "//")
		}
		var st unix.Stat_t
		err := fsLstatAt(fd, part, &st)
		if fsTooLong(prefix) {
			err = unix.ENAMETOOLONG
		}
		if err == unix.ENOENT {
			if err := unix.Mkdirat(fd, part, 0o755); err != nil {
				unix.Close(fd)
				return -1, &fs.PathError{Op: "mkdir", Path: prefix, Err: err}
			}
		} else if err != nil {
			unix.Close(fd)
			return -1, &fs.PathError{Op: "lstat", Path: prefix, Err: err}
		} else if st.Mode&unix.S_IFMT == unix.S_IFLNK {
			unix.Close(fd)
			return -1, symlinkf("%s: %s is a symbolic link; envd does not follow links", shown, prefix)
		} else if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			unix.Close(fd)
			return -1, pathf("%s: %s is not a directory", shown, prefix)
		}
		next, err := unix.Openat(fd, part, fsWalkFlags|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return -1, &fs.PathError{Op: "open", Path: prefix, Err: err}
		}
		fd = next
	}
	return fd, nil
}

// fsOpenToWrite is files.py's _open_to_write: the regular file `name` in dirfd (full is its path) opened to be
// overwritten, created (with mode) if missing. O_NONBLOCK: a FIFO planted at the path would block the open until a
// reader came, holding the call for good; anything but a regular file is refused. The fd is blocking again when
// returned.
func fsOpenToWrite(dirfd int, name, full, shown string, mode uint32) (int, error) {
	fd, err := retryEINTR(func() (int, error) {
		if fsTooLong(full) {
			return -1, unix.ENAMETOOLONG
		}
		return unix.Openat(dirfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, mode)
	})
	if err != nil {
		why := strerror(err)
		if err == unix.ENXIO { // a FIFO with no reader
			why = "not a regular file"
		}
		return -1, pathf("%s: %s", shown, why)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return -1, pathf("%s: not a regular file", shown)
	}
	if err := unix.Ftruncate(fd, 0); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// fsWriteAll writes all of data to fd; an error is the bare errno, as Python's write reports it (no file name).
func fsWriteAll(fd int, data []byte) error {
	for len(data) > 0 {
		n, err := unix.Write(fd, data)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		data = data[n:]
	}
	return nil
}

// fsReadFile is files.py's read_file: up to maxBytes of a regular file, and whether it was longer.
func fsReadFile(path, workspace string, maxBytes int64) ([]byte, bool, error) {
	full, err := fsResolve(path, workspace, false)
	if err != nil {
		return nil, false, err
	}
	fd, err := fsOpenAt(full, unix.O_RDONLY|unix.O_NONBLOCK, 0)
	if err == unix.ENOENT {
		return nil, false, notFoundf("%s: no such file", path)
	} else if err != nil {
		return nil, false, pathf("%s: %s", path, strerror(err))
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, false, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		// Python's os.fdopen refuses a directory's fd before read_file looks at what it opened: an OSError named
		// by the fd's number
		return nil, false, &fs.PathError{Op: "fdopen", Path: strconv.Itoa(fd), Err: unix.EISDIR}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, false, pathf("%s: not a regular file", path)
	}
	// one byte past the limit tells whether there was more (Python's read(max_bytes + 1)); the buffer grows with
	// what is read, not to the limit at once
	want := maxBytes + 1
	// no more than the file's size and the byte past it; st.Size+1 of a file of 2^63-1 bytes (a sparse one on a
	// tmpfs, a `truncate -s` away) wrapped to a negative length, and make() panicked: envd, PID 1, and the sandbox
	// with it, were gone
	size := want
	if st.Size >= 0 && st.Size < want {
		size = st.Size + 1
	}
	data := make([]byte, size)
	n := 0
	for int64(n) < want {
		if n == len(data) {
			grown := make([]byte, minInt64(want, int64(2*n+4096)))
			copy(grown, data[:n])
			data = grown
		}
		r, err := unix.Read(fd, data[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, false, err
		}
		if r == 0 {
			break
		}
		n += r
	}
	if int64(n) > maxBytes {
		return data[:maxBytes], true, nil
	}
	return data[:n], false, nil
}

func minInt64(a, b int64) int64 {
	if a < b {
		return a
	}
	return b
}

// fsWriteFile is files.py's write_file: create or replace a regular file with content and permission bits mode.
func fsWriteFile(path, workspace string, content []byte, mode uint32, makeParents bool) error {
	full, err := fsResolve(path, workspace, false)
	if err != nil {
		return err
	}
	parent, name := fsSplit(full)
	var dirfd int
	if makeParents {
		if dirfd, err = fsMakeDirs(parent, path); err != nil {
			return err
		}
	} else if dirfd, err = fsOpenDir(parent); err != nil {
		return notFoundf("%s: parent directory %s does not exist (set make_parents)", path, parent)
	}
	defer unix.Close(dirfd)
	fd, err := fsOpenToWrite(dirfd, name, full, path, mode&0o777)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Fchmod(fd, mode&0o777); err != nil {
		return err
	}
	return fsWriteAll(fd, content)
}

// fsInfo is files.py's _entry: one file's metadata from its lstat, a link's target read, never followed. Names are
// text: a run of bytes that is no UTF-8 (in a name or a link target a command made) is one U+FFFD (files.py writes
// one per invalid sequence, as Python decodes), since a proto string cannot carry it, and one such name failed a
// whole ListDir (INTERNAL, taken on the host for a dead envd).
func fsInfo(dirfd int, name, full string, st *unix.Stat_t) (*pb.FileInfo, error) {
	info := &pb.FileInfo{
		Name:  strings.ToValidUTF8(fsBasename(full), "\uFFFD"),
		Path:  strings.ToValidUTF8(full, "\uFFFD"),
		Size:  st.Size,
		Mode:  st.Mode & 0o7777,
		Mtime: float64(st.Mtim.Sec) + float64(st.Mtim.Nsec)*1e-9, // as Python computes st_mtime
	}
	if info.Name == "" {
		info.Name = "/"
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFLNK:
		target, err := fsReadlinkat(dirfd, name)
		if err != nil {
			return nil, &fs.PathError{Op: "readlink", Path: full, Err: err}
		}
		info.Kind, info.LinkTarget = pb.FileKind_FILE_KIND_SYMLINK, strings.ToValidUTF8(target, "\uFFFD")
	case unix.S_IFDIR:
		info.Kind = pb.FileKind_FILE_KIND_DIR
	case unix.S_IFREG:
		info.Kind = pb.FileKind_FILE_KIND_FILE
	default:
		info.Kind = pb.FileKind_FILE_KIND_OTHER
	}
	return info, nil
}

// fsLstatShown is files.py's _lstat through a directory fd: a missing file is NOT_FOUND under the caller's path.
// A failure to open the directory is the lstat's failure, as the path-based call would have failed.
func fsLstatShown(full, shown string, st *unix.Stat_t) (dirfd int, name string, err error) {
	dir, name := fsSplit(full)
	dirfd, err = fsOpenDir(dir)
	if err == nil && fsTooLong(full) {
		unix.Close(dirfd)
		err = unix.ENAMETOOLONG
	} else if err == nil {
		if err = fsLstatAt(dirfd, name, st); err != nil {
			unix.Close(dirfd)
		}
	}
	if err == unix.ENOENT {
		return -1, "", notFoundf("%s: no such file or directory", shown)
	} else if err != nil {
		return -1, "", &fs.PathError{Op: "lstat", Path: full, Err: err}
	}
	return dirfd, name, nil
}

// fsStat is files.py's stat_path: lstat of a path; a last component that is a link is reported as a link.
func fsStat(path, workspace string) (*pb.FileInfo, error) {
	full, err := fsResolve(path, workspace, true)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	dirfd, name, err := fsLstatShown(full, path, &st)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dirfd)
	return fsInfo(dirfd, name, full, &st)
}

// fsReadDirNames is the names in an open directory ("." and ".." left out), in the order the kernel gives them.
func fsReadDirNames(fd int) ([]string, error) {
	entries, err := shGetdents(fd)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(entries))
	for i, e := range entries {
		names[i] = e.name
	}
	return names, nil
}

// fsListDir is files.py's list_dir: the entries of a directory, sorted by name.
func fsListDir(path, workspace string) ([]*pb.FileInfo, error) {
	full, err := fsResolve(path, workspace, false)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	parentfd, name, err := fsLstatShown(full, path, &st)
	if err != nil {
		return nil, err
	}
	defer unix.Close(parentfd)
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, pathf("%s: not a directory", path)
	}
	dirfd, err := retryEINTR(func() (int, error) {
		return unix.Openat(parentfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	})
	if err != nil {
		return nil, &fs.PathError{Op: "scandir", Path: full, Err: err}
	}
	defer unix.Close(dirfd)
	names, err := fsReadDirNames(dirfd)
	if err != nil {
		return nil, &fs.PathError{Op: "scandir", Path: full, Err: err}
	}
	sort.Strings(names)
	out := make([]*pb.FileInfo, 0, len(names))
	for _, n := range names {
		child := fsJoin(full, n)
		var cst unix.Stat_t
		if fsTooLong(child) {
			return nil, &fs.PathError{Op: "lstat", Path: child, Err: unix.ENAMETOOLONG}
		}
		if err := fsLstatAt(dirfd, n, &cst); err != nil {
			return nil, &fs.PathError{Op: "lstat", Path: child, Err: err}
		}
		info, err := fsInfo(dirfd, n, child, &cst)
		if err != nil {
			return nil, err
		}
		out = append(out, info)
	}
	return out, nil
}
