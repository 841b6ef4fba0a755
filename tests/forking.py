"""Run test code in a forked child of the test process: the child's memory, CPU time and exit status are
its own, counted from a clean start, without a fresh interpreter's imports (1.6-5 s of CPU each). POSIX
only; the child never returns into pytest.
"""
import contextlib
import ctypes
import gc
import json
import os
import signal
import subprocess
import traceback

import torch


def fork(body) -> int:
    """Start ``body()`` in a forked child that ends there: its exit status is body's int result (0 for any
    other), 1 when it raises (the traceback on stderr). Returns the child's pid, for the caller to wait on or
    signal."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result = body()
            code = result if isinstance(result, int) else 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def fork_call(fn, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    """``fn(*args)`` in a forked child, what it prints coming back through a pipe: a CompletedProcess whose
    returncode is fn's int result (0 for any other, 1 if it raised, -SIGALRM after `timeout` s). Before fn the child
    takes one thread and hands the freed heap back (gc, malloc_trim), so fn cannot reuse resident free pages
    unseen by a memory count."""
    r, w = os.pipe()

    def child():
        os.close(r)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(timeout)
        torch.set_num_threads(1)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with os.fdopen(w, "w") as f, contextlib.redirect_stdout(f):
            return fn(*args)
    pid = fork(child)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess([getattr(fn, "__name__", "fn"), *args], os.waitstatus_to_exitcode(status), out, "")


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0 and done.stdout, f"forked child failed (exit {done.returncode}; its stderr above)"
    return done.stdout


def run_script(script: str, argv: list[str] = (), timeout: int = 300) -> str:
    """``python -c script *argv`` as a forked child (fork_call): its stdout; the child must succeed."""
    def run():
        import sys
        sys.argv = ["-c", *argv]
        exec(script, {"__name__": "__main__"})
    return _ok(fork_call(run, timeout=timeout))


def json_in_fork(fn, *args, timeout: int = 300):
    """``fn(*args)``, a JSON value, computed in a forked child (fork_call)."""
    return json.loads(_ok(fork_call(lambda: print(json.dumps(fn(*args))), timeout=timeout)))
