// envd, compiled: the daemon inside every sandbox, serving protos/envd.proto on a unix socket.
//
// The same daemon as the Python one in envd/ (same options, same token rule, same answers), built as one static
// binary: a gRPC call costs it tens of microseconds of CPU where Python's costs about a millisecond, and an idle
// envd wakes up for nothing. orchestrator/images/envd_go.py builds it.
package main

import (
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	pb "envfleet/envdpb"
)

const (
	tokenVar    = "ENVD_TOKEN"
	defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	usage       = `usage: envd [--socket PATH] [--token-file PATH] [--workspace DIR] [--log-level LEVEL]

  --socket PATH      unix socket path to serve on (default /run/envd/envd.sock)
  --token-file PATH  the sandbox token, read then removed (default: token beside the socket)
  --workspace DIR    default cwd and base of relative paths (default /workspace)
  --log-level LEVEL  logging level (default WARNING)`
)

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
	os.Exit(1)
}

// parseOptions reads `--name value` or `--name=value` pairs over the defaults, exiting with the usage otherwise.
func parseOptions(argv []string) map[string]string {
	opts := map[string]string{
		"socket": "/run/envd/envd.sock", "token-file": "", "workspace": "/workspace", "log-level": "WARNING",
	}
	for i := 0; i < len(argv); i++ {
		arg := argv[i]
		if arg == "-h" || arg == "--help" {
			fmt.Println(usage)
			os.Exit(0)
		}
		name, value, eq := strings.Cut(strings.TrimPrefix(arg, "--"), "=")
		if _, known := opts[name]; !strings.HasPrefix(arg, "--") || !known {
			fail("envd: unknown argument %q\n%s", arg, usage)
		}
		if !eq {
			if i+1 < len(argv) {
				i++
				value = argv[i]
			}
		}
		if value == "" {
			fail("envd: %s needs a value\n%s", arg, usage)
		}
		opts[name] = value
	}
	return opts
}

// takeToken reads the token file and removes it, never following a link: nothing after envd can read it.
func takeToken(path string) (string, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	buf := make([]byte, 4096)
	n, err := unix.Read(fd, buf)
	unix.Close(fd)
	if err != nil {
		return "", err
	}
	if err := unix.Unlink(path); err != nil {
		return "", err
	}
	return strings.TrimSpace(string(buf[:n])), nil
}

// becomeSubreaper makes orphans of envd's commands envd's, not init's; false where the kernel has no sub-reapers
// (gVisor answers EINVAL), and orphans are then looked for under init too.
func becomeSubreaper() bool {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		if err == unix.EINVAL {
			return false
		}
		fail("envd: prctl(PR_SET_CHILD_SUBREAPER): %v", err)
	}
	return true
}

func main() {
	// one sandbox's daemon: one thread runs Go code at a time (two cost more wake-ups between them: the CPU per
	// call went up, measured); the collector keeps its default pace
	runtime.GOMAXPROCS(1)
	log.SetFlags(0)
	log.SetPrefix("envd ")
	opts := parseOptions(os.Args[1:])
	tokenFile := opts["token-file"]
	if tokenFile == "" {
		tokenFile = filepath.Join(filepath.Dir(opts["socket"]), "token")
	}
	token, err := takeToken(tokenFile)
	if err != nil {
		fail("envd: cannot take the token from %s: %s; refusing to serve without a token", tokenFile, strerror(err))
	}
	if token == "" {
		fail("envd: %s is empty; refusing to serve without a token", tokenFile)
	}
	// no process of the sandbox (same uid) may ptrace envd or read its memory or environ through /proc
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		fail("envd: prctl(PR_SET_DUMPABLE): %v", err)
	}
	if err := guardLimits(); err != nil {
		fail("envd: cannot keep the sandbox's processes from setting each other's limits (seccomp): %v", err)
	}
	cfg := defaultConfig(opts["socket"], token, opts["workspace"])
	cfg.Subreaper = becomeSubreaper()
	// the container's environment is the base of every process's; the old token carrier's name is dropped
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok && k != tokenVar {
			cfg.setBaseEnv(k, v)
		}
	}
	spareThreads(spareOSThreads)
	if err := serve(cfg); err != nil {
		fail("envd: %v", err)
	}
}

// Threads made at start, while the sandbox has pids to spare. Go's runtime cannot live without a new OS thread when
// it needs one (it exits), and a fork bomb fills the sandbox's pids limit, which threads count against; threads the
// runtime once made stay for reuse, so these are what envd runs on while a bomb is being killed. With one
// processor (GOMAXPROCS 1) envd's calls need a thread each only while they block in a system call.
const spareOSThreads = 8

// spareThreads has the runtime make n threads at once, then leaves them idle in its pool.
func spareThreads(n int) {
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // this goroutine holds a thread of its own while it sleeps in the kernel
			defer runtime.UnlockOSThread()
			ts := unix.NsecToTimespec(int64(50 * time.Millisecond))
			_ = unix.Nanosleep(&ts, nil)
		}()
	}
	wg.Wait()
}

// serve listens on the socket and serves until SIGTERM or SIGINT; as the container's PID 1, until the container is
// removed.
func serve(cfg *Config) error {
	server := grpc.NewServer(
		grpc.MaxRecvMsgSize(maxMessageBytes),
		grpc.MaxSendMsgSize(maxMessageBytes),
		grpc.MaxHeaderListSize(64<<10), // a token and a few headers; gRPC's default is 16 MiB
		grpc.UnaryInterceptor(tokenUnary(cfg.Token)),
		grpc.StreamInterceptor(tokenStream(cfg.Token)),
	)
	process := newProcessServer(cfg)
	pb.RegisterProcessServer(server, process)
	pb.RegisterFilesystemServer(server, newFilesystemServer(cfg))
	healthServer := health.NewServer()
	healthpb.RegisterHealthServer(server, healthServer)
	_ = os.Remove(cfg.SocketPath)
	lis, err := net.Listen("unix", cfg.SocketPath)
	if err != nil {
		return err
	}
	process.rememberModes() // the socket is there now, and no command has run
	healthServer.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	if self == 1 {
		ignoreSignals()
		return server.Serve(lis)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		done := make(chan struct{})
		go func() { server.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-time.After(time.Second):
			server.Stop()
		}
	}()
	return server.Serve(lis)
}

// ignoreSignals takes every signal from now on and does nothing with it: envd as the sandbox's PID 1.
//
// The kernel delivers no signal to a PID namespace's init from inside the namespace unless init has a handler for
// it, and SIGKILL and SIGSTOP never. Go's runtime has a handler for every signal and exits on most (SIGTERM, SIGINT,
// SIGHUP, SIGQUIT, SIGUSR1, ...): a sandbox's `kill 1` stopped envd, and a policy heading for a reward of 0 made its
// rollout an infrastructure retry. Taken here, they reach nothing; the host removes the container with a SIGKILL,
// which comes from outside the namespace. The handlers stay handlers (not SIG_IGN), so commands start with every
// signal at its default.
func ignoreSignals() {
	taken := make(chan os.Signal, 64)
	signal.Notify(taken)
	go func() {
		for range taken {
		}
	}()
}
