package main

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"syscall"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

const (
	maxMessageBytes = 64 << 20
	// Run answers in one message: its output stops short of the message limit, the rest is room for the framing
	runMaxOutputBytes = maxMessageBytes - (64 << 10)
)

// Config is how one envd serves: where, for whom, and its default limits (envd/server.py's EnvdConfig).
type Config struct {
	SocketPath            string
	Token                 string
	Workspace             string
	DefaultTimeoutS       float64
	MaxTimeoutS           float64
	DefaultMaxOutputBytes int64
	MaxOutputBytesLimit   int64
	DefaultReadBytes      int64
	// false where the kernel refused to make envd a sub-reaper (gVisor): orphans are then looked for under init too
	Subreaper bool
	// the base environment of every command, in order of first setting
	baseKeys []string
	baseEnv  map[string]string
}

func defaultConfig(socket, token, workspace string) *Config {
	c := &Config{
		SocketPath:            socket,
		Token:                 token,
		Workspace:             workspace,
		DefaultTimeoutS:       600,
		MaxTimeoutS:           24 * 3600,
		DefaultMaxOutputBytes: 1 << 20,
		MaxOutputBytesLimit:   256 << 20,
		DefaultReadBytes:      16 << 20,
		Subreaper:             true,
		baseEnv:               map[string]string{},
	}
	for _, kv := range [][2]string{{"PATH", defaultPath}, {"HOME", "/tmp"}, {"LANG", "C.UTF-8"}, {"TZ", "UTC"}, {"TMPDIR", "/tmp"}} {
		c.setBaseEnv(kv[0], kv[1])
	}
	return c
}

func (c *Config) setBaseEnv(k, v string) {
	if _, ok := c.baseEnv[k]; !ok {
		c.baseKeys = append(c.baseKeys, k)
	}
	c.baseEnv[k] = v
}

// --- errors: what envd/errors.py raises, and the gRPC status each becomes ---

type envdError struct {
	code codes.Code
	msg  string
}

func (e *envdError) Error() string { return e.msg }

// invalidf: the request is malformed (INVALID_ARGUMENT).
func invalidf(format string, args ...any) error {
	return &envdError{codes.InvalidArgument, fmt.Sprintf(format, args...)}
}

// notFoundf: the path or process does not exist (NOT_FOUND).
func notFoundf(format string, args ...any) error {
	return &envdError{codes.NotFound, fmt.Sprintf(format, args...)}
}

// symlinkf: the path goes through a symbolic link, which envd never follows (PERMISSION_DENIED).
func symlinkf(format string, args ...any) error {
	return &envdError{codes.PermissionDenied, fmt.Sprintf(format, args...)}
}

// pathf: the path exists but is the wrong kind for the call (FAILED_PRECONDITION).
func pathf(format string, args ...any) error {
	return &envdError{codes.FailedPrecondition, fmt.Sprintf(format, args...)}
}

// internalf: envd itself failed (INTERNAL).
func internalf(format string, args ...any) error {
	return &envdError{codes.Internal, fmt.Sprintf(format, args...)}
}

// strerror is C's text for an errno ("No such file or directory"), as Python's OSError.strerror gives it.
func strerror(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		s := errno.Error()
		if s != "" {
			return strings.ToUpper(s[:1]) + s[1:]
		}
	}
	return err.Error()
}

// toStatus turns envd's errors and OS errors into gRPC statuses with their message; nil stays nil.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if s, ok := status.FromError(err); ok {
		if len(s.Message()) <= maxStatusMessage && utf8.ValidString(s.Message()) {
			return err
		}
		return status.Error(s.Code(), bounded(s.Message()))
	}
	var e *envdError
	if errors.As(err, &e) {
		return status.Error(e.code, bounded(e.msg))
	}
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return status.Error(codes.FailedPrecondition, bounded(fmt.Sprintf("%s: %s", pe.Path, strerror(pe.Err))))
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return status.Error(codes.FailedPrecondition, ": "+strerror(errno))
	}
	return status.Error(codes.Internal, bounded(err.Error()))
}

// maxStatusMessage is the most bytes of a status message kept: a message carries what the caller sent (a path of
// 20,000 characters, in ENAMETOOLONG's), and past grpc's metadata limit (8 KiB) the call broke as INTERNAL "Stream
// removed", which the host takes for a lost sandbox: a masked INFRA_ERROR a policy reached with one read_file.
const maxStatusMessage = 1024

// bounded is msg as UTF-8 text, each byte that is no UTF-8 (a path's) as \xNN, within maxStatusMessage bytes cut at
// a character's start, with how much was cut (the Python envd's _bounded says the same).
func bounded(msg string) string {
	if !utf8.ValidString(msg) {
		var b strings.Builder
		for i := 0; i < len(msg); {
			r, size := utf8.DecodeRuneInString(msg[i:])
			if r == utf8.RuneError && size == 1 {
				fmt.Fprintf(&b, "\\x%02x", msg[i])
			} else {
				b.WriteString(msg[i : i+size])
			}
			i += size
		}
		msg = b.String()
	}
	if len(msg) <= maxStatusMessage {
		return msg
	}
	cut := maxStatusMessage
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return fmt.Sprintf("%s...[%d more bytes]", msg[:cut], len(msg)-cut)
}

// --- the token: every call but grpc.health.v1 carries `authorization: Bearer <token>` ---

const healthPrefix = "/grpc.health.v1."

func authorized(ctx context.Context, expected []byte) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		if subtle.ConstantTimeCompare([]byte(v), expected) == 1 {
			return true
		}
	}
	return false
}

var errDenied = status.Error(codes.Unauthenticated, "missing or wrong sandbox token")

func tokenUnary(token string) grpc.UnaryServerInterceptor {
	expected := []byte("Bearer " + token)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if !strings.HasPrefix(info.FullMethod, healthPrefix) && !authorized(ctx, expected) {
			return nil, errDenied
		}
		resp, err := handler(ctx, req)
		return resp, toStatus(err)
	}
}

func tokenStream(token string) grpc.StreamServerInterceptor {
	expected := []byte("Bearer " + token)
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if !strings.HasPrefix(info.FullMethod, healthPrefix) && !authorized(ss.Context(), expected) {
			return errDenied
		}
		return toStatus(handler(srv, ss))
	}
}

// unixMode is the permission bits of a file as stat's st_mode & 07777 gives them.
func unixMode(fi os.FileInfo) uint32 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Mode & 0o7777
	}
	return uint32(fi.Mode().Perm())
}
