"""The Python tool's child process: set limits, block the network, run one program.

Run by :func:`rlflow.envs.sandbox.run_python` as
``python -I sandbox_child.py LIMITS_JSON CODE_FILE`` in a fresh temporary working folder and
its own session (process group). Standard library only: ``-I`` keeps ``PYTHONPATH``, the user's
site-packages and the script folder off ``sys.path``, so nothing of the caller's is imported
by accident (the interpreter's own site-packages stay importable: numpy, sympy, ...).

Before the program runs, in this order:
  * ``RLIMIT_CORE`` 0 (a crash writes no core file), ``RLIMIT_FSIZE`` (file size),
    ``RLIMIT_CPU`` (soft: SIGXCPU, hard one second later: SIGKILL),
    ``RLIMIT_AS`` = what the interpreter maps now + ``memory_mb`` (``MemoryError`` past it);
  * an audit hook (PEP 578) that raises ``PermissionError`` on every ``socket.*`` event
    (creating, connecting, binding a socket, name resolution) and on starting processes
    (``subprocess.Popen``, ``os.system``, ``os.exec*``, ``os.posix_spawn``, ``os.spawn*``,
    ``os.fork``) and on signalling any process but its own (``os.kill`` / ``os.killpg`` of
    another pid or group, ``signal.pthread_kill`` is its own threads: allowed): the tool's
    code could otherwise kill the environment worker that runs it, or with ``os.kill(-1,
    9)`` every process of the user. Audit hooks cannot be removed once added.

Limits of the audit hook: it stops Python-level calls only. Native code (``ctypes`` calling
libc's ``socket``/``connect``, a C extension) bypasses it. :mod:`rlflow.envs.sandbox` adds a
network namespace without network devices (``unshare -rn``) when the kernel allows it, which
also stops native code; otherwise, for untrusted code, run the sampler in a container
without network.
"""

import importlib.util
import json
import os
import sys

FILENAME = "<python tool>"
BLOCKED_PREFIXES = ("socket.",)
BLOCKED_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
                            "os.spawn", "os.fork", "os.forkpty"})


def _audit(event, args):
    if event.startswith(BLOCKED_PREFIXES):
        raise PermissionError(f"network access is disabled in the python tool ({event})")
    if event in BLOCKED_EVENTS:
        raise PermissionError(f"starting processes is disabled in the python tool ({event})")
    if event in ("os.kill", "os.killpg") and not _own(event, int(args[0])):
        raise PermissionError(f"signalling other processes is disabled in the python tool "
                              f"({event} {args[0]})")


def _own(event: str, target: int) -> bool:
    """``target`` (a pid of ``os.kill``, a group of ``os.killpg``) is this process or its
    own process group (the sandbox runs in its own session)."""
    if event == "os.killpg":
        return target in (0, os.getpgrp())
    return target in (0, os.getpid(), -os.getpgrp())


def _load_limits_module():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "system", "process_limits.py")
    spec = importlib.util.spec_from_file_location("_rlflow_process_limits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(limits_json: str, code_file: str) -> None:
    import resource

    limits = json.loads(limits_json)
    with open(code_file) as f:
        code = f.read()
    process_limits = _load_limits_module()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    fsize = int(limits["file_size_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    cpu = max(1, int(limits["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    import linecache

    linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)  # tracebacks
    compiled = compile(code, FILENAME, "exec")         # a SyntaxError is reported below
    process_limits.set_memory_limit(int(limits["memory_mb"]))
    sys.addaudithook(_audit)
    exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - the traceback is the tool's answer
        import traceback

        exc_type, exc, tb = sys.exc_info()
        # drop this file's frames (set-up, the audit hook): the model sees its own code only
        frames = [f for f in traceback.extract_tb(tb) if f.filename != __file__]
        sys.stdout.flush()
        text = "".join(traceback.format_exception_only(exc_type, exc))
        if frames:
            text = ("Traceback (most recent call last):\n"
                    + "".join(traceback.format_list(frames)) + text)
        sys.stderr.write(text)
        sys.stderr.flush()
        os._exit(1)
