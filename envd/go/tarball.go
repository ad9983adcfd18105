package main

// Tar archives for Upload and Download (envd/files.py's extract_tar, build_tar, spool), and the spool they pass
// through.

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/user"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
)

const (
	spoolBytes  = 8 << 20 // files.py's SPOOL_BYTES: a spool holds this much in memory, more goes to a file
	chunkBytes  = 1 << 20 // files.py's CHUNK_BYTES: Download's pieces, and Upload's copy buffer
	tarBlock    = 512
	tarRecord   = 20 * tarBlock // Python's tarfile pads an archive it writes to a whole record
	tarReadSize = 64 << 10      // the buffer under the tar reader (it peeks at most two blocks)
)

// --- the spool ---

// fsSpool is Python's tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES): bytes in memory up to spoolBytes, then
// an unlinked file in the temporary directory ($TMPDIR, else /tmp). Its errors are bare errnos: Python reports a
// write's failure without a file name (": No space left on device").
type fsSpool struct {
	mem  []byte
	off  int // where Read is in mem
	file *os.File
	size int64
}

func newFsSpool() *fsSpool { return &fsSpool{} }

func (s *fsSpool) Write(p []byte) (int, error) {
	if s.file == nil && len(s.mem)+len(p) > spoolBytes {
		f, err := os.CreateTemp("", "envd-spool-")
		if err != nil {
			return 0, bareErrno(err)
		}
		_ = os.Remove(f.Name())
		s.file = f
		if _, err := f.Write(s.mem); err != nil {
			return 0, bareErrno(err)
		}
		s.mem = nil
	}
	if s.file != nil {
		n, err := s.file.Write(p)
		s.size += int64(n)
		return n, bareErrno(err)
	}
	if need := len(s.mem) + len(p); need > cap(s.mem) {
		// grow by doubling, never past the spool's own limit
		grown := make([]byte, len(s.mem), minInt64(int64(spoolBytes), int64(2*need)))
		copy(grown, s.mem)
		s.mem = grown
	}
	s.mem = append(s.mem, p...)
	s.size += int64(len(p))
	return len(p), nil
}

// Rewind puts the read position back at the start.
func (s *fsSpool) Rewind() error {
	s.off = 0
	if s.file != nil {
		_, err := s.file.Seek(0, io.SeekStart)
		return bareErrno(err)
	}
	return nil
}

func (s *fsSpool) Read(p []byte) (int, error) {
	if s.file != nil {
		n, err := s.file.Read(p)
		if err != io.EOF {
			err = bareErrno(err)
		}
		return n, err
	}
	if s.off >= len(s.mem) {
		return 0, io.EOF
	}
	n := copy(p, s.mem[s.off:])
	s.off += n
	return n, nil
}

func (s *fsSpool) Close() error {
	s.mem = nil
	if s.file != nil {
		return s.file.Close()
	}
	return nil
}

// bareErrno is the errno of an *os.PathError, without the path; other errors as they are.
func bareErrno(err error) error {
	var errno unix.Errno
	if err != nil && errors.As(err, &errno) {
		return errno
	}
	return err
}

// --- reading a tar as Python's tarfile.open(fileobj, mode="r|*") reads it ---

// cutTar is a failure past the archive's first member (Python's tarfile.ReadError out of the loop): the upload's
// own fault, INVALID_ARGUMENT. It was UNKNOWN, which the host reads as an unavailable sandbox, retried for ever.
func cutTar(msg string) error { return invalidf("upload is not a complete tar archive: %s", msg) }

func notTar(msg string) error { return invalidf("upload is not a tar archive: %s", msg) }

// fsCompressedError is a failure of the decompressor under the tar reader (Python's "invalid compressed data").
type fsCompressedError struct{ err error }

func (e *fsCompressedError) Error() string { return "invalid compressed data: " + e.err.Error() }

// fsDecompressed tags its reader's failures as fsCompressedError. A stream that just ends early, or whose trailer
// is missing or wrong, is only short: Python's decompressors neither check the gzip trailer nor fail on a cut
// stream, so its tar reader sees the data that was there.
type fsDecompressed struct{ r io.Reader }

func (d fsDecompressed) Read(p []byte) (int, error) {
	n, err := d.r.Read(p)
	switch {
	case err == nil || err == io.EOF:
	case err == io.ErrUnexpectedEOF || err == gzip.ErrChecksum:
		err = io.EOF
	default:
		err = &fsCompressedError{err}
	}
	return n, err
}

// fsCounted counts the bytes the tar reader takes: where it is in the (decompressed) archive.
type fsCounted struct {
	r *bufio.Reader
	n int64
}

func (c *fsCounted) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// fsTarReader walks a tar stream member by member as Python's tarfile does in stream mode, over archive/tar. The
// same compressions are recognised by their magic (gzip and bzip2; Go's library has no xz). Each header block is
// first checked as Python's TarInfo.frombuf checks it: a bad first one is "not a tar archive" in Python's words,
// while an empty, truncated, zero or bad header after the first ends the archive quietly (tarfile stops there). A
// member's data cut short, or a bad header after an extended one, is an error as it is in tarfile.
type fsTarReader struct {
	in    *fsCounted
	tr    *tar.Reader
	first bool // no member has been read yet: Python is still in tarfile.open
}

func fsOpenTar(src io.Reader) (*fsTarReader, error) {
	raw := bufio.NewReaderSize(src, tarReadSize)
	head, _ := raw.Peek(tarBlock) // Python's _StreamProxy looks at the first block read
	var stream io.Reader = raw
	switch {
	case bytes.HasPrefix(head, []byte("\x1f\x8b\x08")):
		gz, err := gzip.NewReader(raw)
		if err != nil {
			return nil, notTar("invalid compressed data")
		}
		gz.Multistream(false) // Python reads one gzip member; what follows it is never looked at
		stream = fsDecompressed{gz}
	case len(head) >= 10 && string(head[:3]) == "BZh" && string(head[4:10]) == "1AY&SY":
		stream = fsDecompressed{bzip2.NewReader(raw)}
	case bytes.HasPrefix(head, []byte("\x5d\x00\x00\x80")) || bytes.HasPrefix(head, []byte("\xfd7zXZ")):
		return nil, notTar("xz compression is not supported by this envd")
	}
	in := &fsCounted{r: bufio.NewReaderSize(stream, tarReadSize)}
	return &fsTarReader{in: in, tr: tar.NewReader(in), first: true}, nil
}

// fail is an error while reading the archive: in Python's tarfile.open (the first member) it is "not a tar
// archive", later "not a complete tar archive".
func (r *fsTarReader) fail(msg string) error {
	if r.first {
		return notTar(msg)
	}
	return cutTar(msg)
}

// readFailure is Python's words for a failure of the tar reader or the decompressor under it.
func readFailure(err error) string {
	var ce *fsCompressedError
	switch {
	case errors.As(err, &ce):
		return "invalid compressed data"
	case err == io.ErrUnexpectedEOF:
		return "unexpected end of data"
	}
	return err.Error()
}

// next is the next member, or io.EOF at the end of the archive.
func (r *fsTarReader) next() (*tar.Header, error) {
	subsequent := false // the header read follows a global extended one: Python reads both as one
	for {
		// the rest of the last member's data (Python seeks over it): a cut one is an error
		if _, err := io.Copy(io.Discard, r.tr); err != nil {
			return nil, cutTar(readFailure(err))
		}
		// the next header starts at the next block boundary; Python checks the stream reaches it
		pad := int((tarBlock - r.in.n%tarBlock) % tarBlock)
		peek, err := r.in.r.Peek(pad + tarBlock)
		if err != nil && err != io.EOF && err != bufio.ErrBufferFull {
			return nil, r.fail(readFailure(err))
		}
		if len(peek) < pad {
			return nil, cutTar("unexpected end of data")
		}
		if problem := fsHeaderProblem(peek[pad:]); problem != "" {
			switch {
			case subsequent:
				return nil, r.fail(problem)
			case !r.first || problem == "end of file header":
				return nil, io.EOF // where tarfile stops; a block of zeros first is an empty archive
			case problem == "empty header":
				return nil, notTar("empty file")
			default:
				return nil, notTar(problem)
			}
		}
		start := r.in.n + int64(pad)
		hdr, err := r.tr.Next()
		if err != nil {
			// the header block itself was good: what failed came with it (an extended header's records, the
			// header after a long name or an extended header), which tarfile reports as that header's error
			msg := "invalid header"
			if err == io.EOF || err == io.ErrUnexpectedEOF {
				// the stream ended after this (extended) header: tarfile reads its data, padded, in one short
				// read, then finds no header after it ("empty") or part of one ("truncated")
				size, _ := pyNti(peek[pad+124 : pad+136])
				msg = "empty header"
				if r.in.n > start+tarBlock+(size+tarBlock-1)/tarBlock*tarBlock {
					msg = "truncated header"
				}
			} else if err != tar.ErrHeader {
				msg = readFailure(err)
			}
			return nil, r.fail(msg)
		}
		if hdr.Typeflag == tar.TypeXGlobalHeader {
			// Go hands a global extended header out as a member; tarfile keeps it and reads the next header
			subsequent = true
			continue
		}
		r.first = false
		return hdr, nil
	}
}

// fsHeaderProblem is what Python's TarInfo.frombuf finds wrong in a header block, in its words, or "" if nothing.
// "end of file header" is a block of zeros.
func fsHeaderProblem(block []byte) string {
	switch {
	case len(block) == 0:
		return "empty header"
	case len(block) != tarBlock:
		return "truncated header"
	case bytes.Count(block, []byte{0}) == tarBlock:
		return "end of file header"
	}
	chksum, ok := pyNti(block[148:156])
	if !ok {
		return "invalid header"
	}
	unsigned, signed := int64(256), int64(256) // the checksum field counts as eight spaces
	for i, b := range block {
		if i < 148 || i >= 156 {
			unsigned += int64(b)
			signed += int64(int8(b))
		}
	}
	if chksum != unsigned && chksum != signed {
		return "bad checksum"
	}
	for _, f := range [][2]int{{100, 108}, {108, 116}, {116, 124}, {124, 136}, {136, 148}, {329, 337}, {337, 345}} {
		if _, ok := pyNti(block[f[0]:f[1]]); !ok {
			return "invalid header"
		}
	}
	return ""
}

// pyNti is tarfile's nti: a number field, base-256 when its first byte says so, else octal ASCII up to a NUL, as
// Python's int(s.strip() or "0", 8) reads it (spaces around, a sign, a 0o prefix, underscores between digits).
func pyNti(field []byte) (int64, bool) {
	if field[0] == 0o200 || field[0] == 0o377 {
		var n int64
		for _, b := range field[1:] {
			n = n<<8 + int64(b)
		}
		if field[0] == 0o377 {
			n -= int64(1) << (8 * uint(len(field)-1))
		}
		return n, true
	}
	if i := bytes.IndexByte(field, 0); i >= 0 {
		field = field[:i]
	}
	for _, b := range field {
		if b >= 0x80 {
			return 0, false // not ASCII
		}
	}
	s := strings.TrimFunc(string(field), func(r rune) bool {
		return r == ' ' || (r >= '\t' && r <= '\r') || (r >= 0x1c && r <= 0x1f)
	})
	if s == "" {
		return 0, true
	}
	neg := false
	if s[0] == '+' || s[0] == '-' {
		neg, s = s[0] == '-', s[1:]
	}
	if len(s) > 2 && s[0] == '0' && (s[1] == 'o' || s[1] == 'O') {
		s = s[2:]
		if s[0] == '_' {
			s = s[1:]
		}
	}
	if s == "" || s[0] == '_' || s[len(s)-1] == '_' || strings.Contains(s, "__") {
		return 0, false
	}
	n, err := strconv.ParseInt(strings.ReplaceAll(s, "_", ""), 8, 64)
	if err != nil {
		return 0, false
	}
	if neg {
		n = -n
	}
	return n, true
}

// fsMemberName is a member's name as tarfile gives it: a directory's, and any name from an extended header, without
// its trailing slashes.
func fsMemberName(hdr *tar.Header) string {
	if _, pax := hdr.PAXRecords["path"]; pax || hdr.Typeflag == tar.TypeDir {
		return strings.TrimRight(hdr.Name, "/")
	}
	return hdr.Name
}

// fsMemberTarget is files.py's _member_target: where a member named `name` lands under dest, refusing a name that
// is absolute or climbs out of it.
func fsMemberTarget(dest, name string) (string, error) {
	norm := fsNormpath(name)
	if strings.HasPrefix(name, "/") || norm == ".." || strings.HasPrefix(norm, "../") {
		return "", invalidf("tar member %s escapes the destination directory", pyRepr(name))
	}
	return fsJoin(dest, norm), nil
}

// fsExtractTar is files.py's extract_tar: the archive extracted into destDir (made if missing), refusing members
// that would land, or point, outside it, and devices and FIFOs. It returns how many files, links and hard links it
// made (directories are not counted).
func fsExtractTar(src io.Reader, destDir, workspace string) (int, error) {
	dest, err := fsResolve(destDir, workspace, false)
	if err != nil {
		return 0, err
	}
	destfd, err := fsMakeDirs(dest, destDir)
	if err != nil {
		return 0, err
	}
	unix.Close(destfd)
	r, err := fsOpenTar(src)
	if err != nil {
		return 0, err
	}
	x := &fsExtractor{dest: dest, r: r}
	for {
		hdr, err := r.next()
		if err == io.EOF {
			return x.count, nil
		}
		if err != nil {
			return x.count, err
		}
		if err := x.member(hdr); err != nil {
			return x.count, err
		}
	}
}

type fsExtractor struct {
	dest  string
	r     *fsTarReader
	count int
	buf   []byte // the copy buffer, made for the first file
}

// fsInside is _inside: whether the normalized absolute path is root or lies under it ("/" holds every path).
func fsInside(path, root string) bool {
	return path == root || strings.HasPrefix(path, strings.TrimRight(root, "/")+"/")
}

// member extracts one member, as one turn of extract_tar's loop.
func (x *fsExtractor) member(hdr *tar.Header) error {
	name := fsMemberName(hdr)
	target, err := fsMemberTarget(x.dest, name)
	if err != nil {
		return err
	}
	if target == x.dest {
		return nil
	}
	parent, base := fsSplit(target)
	// a link extracted earlier (or planted) is never written through
	if _, err := fsResolve(parent, "/", false); err != nil {
		return err
	}
	dirfd, err := fsMakeDirs(parent, name)
	if err != nil {
		return err
	}
	defer unix.Close(dirfd)
	var st unix.Stat_t
	switch hdr.Typeflag {
	case tar.TypeDir:
		fd, err := fsMakeDirs(target, name)
		if err != nil {
			return err
		}
		unix.Close(fd)
		return fsChmodDir(dirfd, base, target, uint32(hdr.Mode&0o777)|0o700)
	case tar.TypeReg, tar.TypeCont, tar.TypeGNUSparse: // tarfile's REGULAR_TYPES (Go has made '\x00' one of these)
		if fsLstatAt(dirfd, base, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
			if err := unix.Unlinkat(dirfd, base, 0); err != nil {
				return pathf("%s: %s", name, strerror(err))
			}
		}
		fd, err := fsOpenToWrite(dirfd, base, target, name, 0o600)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if x.buf == nil {
			x.buf = make([]byte, chunkBytes)
		}
		// chunk by chunk, as tarfile's reads of CHUNK_BYTES: a chunk cut short by the end of the stream is an
		// error, and none of it is written
		for left := hdr.Size; left > 0; {
			n, err := io.ReadFull(x.r.tr, x.buf[:minInt64(left, chunkBytes)])
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			if err != nil {
				return cutTar(readFailure(err))
			}
			if err := fsWriteAll(fd, x.buf[:n]); err != nil {
				return err
			}
			left -= int64(n)
		}
		if err := unix.Fchmod(fd, uint32(hdr.Mode&0o777)); err != nil {
			return err
		}
		x.count++
	case tar.TypeSymlink:
		// where the link points, absolute or relative, is judged on its normalized path: inside the destination
		// or refused (at "/" nothing is outside); a member is never written through a link in any case
		if !fsInside(fsNormpath(fsJoin(parent, hdr.Linkname)), x.dest) {
			return invalidf("tar member %s is a link out of the destination (%s)", pyRepr(name), hdr.Linkname)
		}
		if fsLstatAt(dirfd, base, &st) == nil {
			if err := unix.Unlinkat(dirfd, base, 0); err != nil {
				return &fs.PathError{Op: "unlink", Path: target, Err: err}
			}
		}
		if err := unix.Symlinkat(hdr.Linkname, dirfd, base); err != nil {
			return &fs.PathError{Op: "symlink", Path: hdr.Linkname, Err: err} // os.symlink names its source
		}
		x.count++
	case tar.TypeLink:
		source, err := fsMemberTarget(x.dest, hdr.Linkname)
		if err != nil {
			return err
		}
		if _, err := fsResolve(source, "/", false); err != nil {
			return err
		}
		srcDir, srcName := fsSplit(source)
		srcfd, err := fsOpenDir(srcDir)
		if err == nil && (fsTooLong(source) || fsTooLong(target)) {
			unix.Close(srcfd)
			err = unix.ENAMETOOLONG
		}
		if err != nil {
			return &fs.PathError{Op: "link", Path: source, Err: err}
		}
		defer unix.Close(srcfd)
		// flags 0: a link as the source is linked itself, never followed (follow_symlinks=False)
		if err := unix.Linkat(srcfd, srcName, dirfd, base, 0); err != nil {
			return &fs.PathError{Op: "link", Path: source, Err: err}
		}
		x.count++
	default:
		return invalidf("tar member %s: devices and fifos are not allowed", pyRepr(name))
	}
	return nil
}

// fsChmodDir sets the mode of the directory `name` in dirfd through an fd of it opened with O_NOFOLLOW. Where
// envd may not read the directory (so not open it), it falls back to fchmodat by name, as Python's os.chmod does.
func fsChmodDir(dirfd int, name, full string, mode uint32) error {
	fd, err := retryEINTR(func() (int, error) {
		return unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	})
	if err == nil {
		err = unix.Fchmod(fd, mode)
		unix.Close(fd)
	} else if err == unix.EACCES {
		err = unix.Fchmodat(dirfd, name, mode, 0)
	}
	if err != nil {
		return &fs.PathError{Op: "chmod", Path: full, Err: err}
	}
	return nil
}

// --- writing a tar as Python's tarfile.add(path, recursive=True) writes it (PAX format) ---

// fsBuildTar is files.py's build_tar: a spooled tar of a file or directory tree, links stored as links, read
// through directory fds so nothing is followed. The caller closes it.
func fsBuildTar(path, workspace string, maxBytes int64) (*fsSpool, error) {
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
	arcname := fsBasename(full)
	if arcname == "" {
		arcname = "."
	}
	spool := newFsSpool()
	var w io.Writer = spool
	if maxBytes > 0 { // past it the tree is read no further (files.py's _Capped)
		w = &cappedWriter{spool, maxBytes, path}
	}
	b := &fsTarBuilder{
		tw: tar.NewWriter(w), inodes: map[[2]uint64]string{}, unames: map[uint32]string{}, gnames: map[uint32]string{},
	}
	err = b.add(dirfd, name, full, arcname)
	if err == nil {
		err = b.tw.Close()
	}
	if err == nil && spool.size%tarRecord != 0 { // through the cap, as Python's tarfile pads through _Capped
		_, err = w.Write(make([]byte, tarRecord-spool.size%tarRecord))
	}
	if err == nil {
		err = spool.Rewind()
	}
	if err != nil {
		spool.Close()
		return nil, err
	}
	return spool, nil
}

// cappedWriter refuses a write that takes the spool past max bytes: RESOURCE_EXHAUSTED.
type cappedWriter struct {
	spool *fsSpool
	max   int64
	path  string
}

func (c *cappedWriter) Write(p []byte) (int, error) {
	if c.spool.size+int64(len(p)) > c.max {
		return 0, &envdError{codes.ResourceExhausted, fmt.Sprintf("the archive of %s is over max_bytes = %d", pyRepr(c.path), c.max)}
	}
	return c.spool.Write(p)
}

type fsTarBuilder struct {
	tw     *tar.Writer
	inodes map[[2]uint64]string // (inode, device) -> the name a regular file was archived under: later ones link it
	unames map[uint32]string
	gnames map[uint32]string
	buf    []byte
}

func (b *fsTarBuilder) uname(uid uint32) string {
	name, ok := b.unames[uid]
	if !ok {
		if u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10)); err == nil {
			name = u.Username
		}
		b.unames[uid] = name
	}
	return name
}

func (b *fsTarBuilder) gname(gid uint32) string {
	name, ok := b.gnames[gid]
	if !ok {
		if g, err := user.LookupGroupId(strconv.FormatUint(uint64(gid), 10)); err == nil {
			name = g.Name
		}
		b.gnames[gid] = name
	}
	return name
}

// add archives `name` in dirfd (full is its path, for messages) as arcname, and a directory's entries after it,
// sorted by name: tarfile's add and gettarinfo. A socket is left out.
func (b *fsTarBuilder) add(dirfd int, name, full, arcname string) error {
	var st unix.Stat_t
	if fsTooLong(full) {
		return &fs.PathError{Op: "lstat", Path: full, Err: unix.ENAMETOOLONG}
	}
	if err := fsLstatAt(dirfd, name, &st); err != nil {
		return &fs.PathError{Op: "lstat", Path: full, Err: err}
	}
	stored := strings.TrimLeft(arcname, "/")
	hdr := &tar.Header{
		Name:    stored,
		Mode:    int64(st.Mode & 0o7777),
		Uid:     int(st.Uid),
		Gid:     int(st.Gid),
		Uname:   b.uname(st.Uid),
		Gname:   b.gname(st.Gid),
		ModTime: time.Unix(st.Mtim.Sec, st.Mtim.Nsec),
		Format:  tar.FormatPAX, // sub-second mtimes kept, as tarfile's PAX_FORMAT keeps its float mtime
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		inode := [2]uint64{st.Ino, st.Dev}
		if first, seen := b.inodes[inode]; st.Nlink > 1 && seen && stored != first {
			hdr.Typeflag, hdr.Linkname = tar.TypeLink, first // a hard link to a file already archived
		} else {
			hdr.Typeflag, hdr.Size = tar.TypeReg, st.Size
			if st.Ino != 0 {
				b.inodes[inode] = stored
			}
		}
	case unix.S_IFDIR:
		hdr.Typeflag = tar.TypeDir
		hdr.Name += "/"
	case unix.S_IFIFO:
		hdr.Typeflag = tar.TypeFifo
	case unix.S_IFLNK:
		target, err := fsReadlinkat(dirfd, name)
		if err != nil {
			return &fs.PathError{Op: "readlink", Path: full, Err: err}
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
	case unix.S_IFCHR, unix.S_IFBLK:
		hdr.Typeflag = tar.TypeChar
		if st.Mode&unix.S_IFMT == unix.S_IFBLK {
			hdr.Typeflag = tar.TypeBlock
		}
		hdr.Devmajor, hdr.Devminor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
	default:
		return nil // a socket: tarfile has no type for it and skips it
	}
	switch hdr.Typeflag {
	case tar.TypeReg:
		return b.addFile(dirfd, name, full, hdr)
	case tar.TypeDir:
		if err := b.tw.WriteHeader(hdr); err != nil {
			return err
		}
		return b.addEntries(dirfd, name, full, arcname)
	}
	return b.tw.WriteHeader(hdr)
}

// addFile archives a regular file's header and exactly the size lstat gave (tarfile's addfile).
func (b *fsTarBuilder) addFile(dirfd int, name, full string, hdr *tar.Header) error {
	// O_NONBLOCK: a FIFO swapped in after the lstat does not block the open; it is refused below
	fd, err := retryEINTR(func() (int, error) {
		return unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	})
	if err != nil {
		return &fs.PathError{Op: "open", Path: full, Err: err}
	}
	f := os.NewFile(uintptr(fd), full)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return pathf("%s: not a regular file", full)
	}
	if err := b.tw.WriteHeader(hdr); err != nil {
		return err
	}
	if b.buf == nil {
		b.buf = make([]byte, 64<<10)
	}
	n, err := io.CopyBuffer(b.tw, io.LimitReader(fsBareReader{f}, hdr.Size), b.buf)
	if err != nil {
		return err
	}
	if n < hdr.Size {
		// the file shrank since its lstat: tarfile's copyfileobj raises OSError("unexpected end of data"), which
		// the Python envd's error mapping turned into this (no file name, no strerror)
		return pathf(": None")
	}
	return nil
}

// fsBareReader reads a file with its errors as bare errnos (Python's read reports no file name).
type fsBareReader struct{ f *os.File }

func (r fsBareReader) Read(p []byte) (int, error) {
	n, err := r.f.Read(p)
	if err != io.EOF {
		err = bareErrno(err)
	}
	return n, err
}

// addEntries archives a directory's entries, sorted by name, each through an fd of the directory.
func (b *fsTarBuilder) addEntries(dirfd int, name, full, arcname string) error {
	fd, err := retryEINTR(func() (int, error) {
		return unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	})
	if err != nil {
		return &fs.PathError{Op: "listdir", Path: full, Err: err}
	}
	defer unix.Close(fd)
	names, err := fsReadDirNames(fd)
	if err != nil {
		return &fs.PathError{Op: "listdir", Path: full, Err: err}
	}
	sort.Strings(names)
	for _, n := range names {
		if err := b.add(fd, n, fsJoin(full, n), fsJoin(arcname, n)); err != nil {
			return err
		}
	}
	return nil
}
