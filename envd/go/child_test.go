package main

// Unit tests of what envd does to a process it did not start itself, on real processes (tests/envd/test_go.py
// runs them with `go test`).

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// readAdj is a process's oom_score_adj, or "" where it is gone.
func readAdj(pid int) string {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/oom_score_adj")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(data))
}

// A command that forked before envd's write (its workers, started while envd waited for a core) has its
// descendants found and given 1000 too, grandchildren included: at 0 they outlived envd in an OOM.
func TestFirstToGoReachesWhatTheCommandForkedBefore(t *testing.T) {
	cmd := exec.Command("/bin/sh", "-c", "sleep 60 & sh -c 'sleep 60 & wait' & wait")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	}()
	var tree []int
	for deadline := time.Now().Add(10 * time.Second); len(tree) < 4; {
		if time.Now().After(deadline) {
			t.Fatalf("the command's tree did not come up: %v", tree)
		}
		time.Sleep(10 * time.Millisecond)
		tree = []int{cmd.Process.Pid}
		for i := 0; i < len(tree); i++ {
			tree = append(tree, children(tree[i])...)
		}
	}
	for _, pid := range tree {
		if adj := readAdj(pid); adj == "1000" {
			t.Fatalf("process %d starts at 1000: the test shows nothing", pid)
		}
	}
	firstToGo(cmd.Process.Pid)
	for _, pid := range tree {
		if adj := readAdj(pid); adj != "1000" {
			t.Errorf("process %d of the command's tree %v is at %q after firstToGo, not 1000", pid, tree, adj)
		}
	}
}
