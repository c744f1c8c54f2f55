"""Tool calls (Hermes format), the sandboxed python tool and the gsm8k_calculator environment.

The sandbox cases run real child processes (~0.2 s each on an idle core); limits are chosen so
that each case can only end by the limit it tests (the wall-clock limit is far above the CPU
limit in the CPU case), and nothing asserts on elapsed time.
"""

import json
import socket

import pytest

from rlflow.envs import EnvError, get_environment
from rlflow.envs.sandbox import SandboxLimits, network_namespace_available, run_python
from rlflow.envs.tools import ToolCall, ToolCallError, parse_tool_calls


def call(code: str) -> str:
    return ("I will compute.\n<tool_call>\n"
            + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>")


# ---------------------------------------------------------------- parsing

def test_parse_tool_calls():
    assert parse_tool_calls("The answer is 4. #### 4") == []
    two = call("print(1)") + '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"x\\"}"}' \
        "</tool_call>"
    assert parse_tool_calls(two) == [ToolCall("python", {"code": "print(1)"}),
                                     ToolCall("python", {"code": "x"})]


@pytest.mark.parametrize("text, match", [
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}', "1 <tool_call> but 0"),
    ('<tool_call>{"name": "python", "arguments": {"code": }}</tool_call>', "tool call 1: invalid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
])
def test_malformed_tool_calls_get_a_message(text, match):
    with pytest.raises(ToolCallError, match=match):
        parse_tool_calls(text)


# ---------------------------------------------------------------- sandbox, through the env

@pytest.fixture()
def listener():
    """A TCP server on 127.0.0.1 that a program without the sandbox could connect to."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    yield srv.getsockname()[1]
    srv.close()


def test_sandbox_limits_return_errors_and_are_counted(listener):
    make = get_environment("gsm8k_calculator")
    # wall clock far above the CPU limit: the loop can only end by RLIMIT_CPU
    env = make({"question": "What is 6 times 7?", "answer": "#### 42"}, max_tool_calls=20,
               timeout_s=120.0, cpu_s=1, memory_mb=256)
    assert env.reset()[1] == {"role": "user", "content": "What is 6 times 7?"}
    cases = [
        ("while True: pass", "tool_timeouts", "CPU time"),
        ("x = bytearray(10 * 1024**3)\nprint('allocated')", "tool_errors", "out of memory"),
        (f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {listener}))\n"
         f"print('connected')", "tool_errors", "network access is disabled"),
        ("import os\nos.abort()", "tool_errors", "crashed (killed by SIGABRT)"),
        ("import ctypes\nctypes.string_at(0)", "tool_errors", "crashed (killed by SIGSEGV)"),
        ("import subprocess\nsubprocess.run(['true'])", "tool_errors",
         "starting processes is disabled"),
        # the worker that runs the tool (its parent), or every process of the user
        ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "tool_errors",
         "signalling other processes is disabled"),
        ("import os\nos.kill(-1, 9)", "tool_errors", "signalling other processes is disabled"),
        ("import os\nos.killpg(1, 9)", "tool_errors", "signalling other processes is disabled"),
        # its own process: allowed (a crash of the tool call, nothing else)
        ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", "tool_errors",
         "killed by SIGTERM"),
    ]
    for code, counter, text in cases:
        step = env.step(call(code))
        assert not step.done, code
        assert len(step.messages) == 1 and step.messages[0]["role"] == "tool"
        assert text in step.messages[0]["content"], (code, step.messages[0]["content"])
        assert "allocated" not in step.messages[0]["content"]
        assert "connected" not in step.messages[0]["content"]
        assert step.info["tool_calls"] == 1 and step.info[counter] == 1, (code, step.info)
        assert sum(step.info.values()) == 2, (code, step.info)
    step = env.step(call("print(6 * 7)"))                  # the next call still works
    assert step.messages == [{"role": "tool", "content": "42\n"}]
    assert step.info == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
    final = env.step("So the answer is 42.\n#### 42")
    assert final.done and final.reward == 1.0


def test_wall_clock_timeout_kills_the_process_group():
    # the child starts a grandchild-free sleep (process creation is blocked), so only the
    # wall-clock limit can end it; its output before the kill is kept
    r = run_python("print('started', flush=True)\nimport time\ntime.sleep(600)",
                   SandboxLimits(timeout_s=1.0, cpu_s=5))
    assert r.status == "timeout" and r.output.startswith("started")
    assert "timed out after 1 s" in r.output
    r = run_python("print('x' * 100000)", SandboxLimits(max_output_bytes=50000,
                                                       max_output_chars=10))
    assert r.status == "output_limit" and r.output.startswith("x" * 10 + "\n[output cut")


@pytest.mark.skipif(not network_namespace_available(), reason="no unprivileged netns here")
def test_network_namespace_stops_native_code(listener):
    # libc socket()/connect() through ctypes bypass the audit hook; the namespace has no
    # route to the parent's 127.0.0.1
    code = f"""
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)
addr = struct.pack('<HH4s8x', 2, ({listener} >> 8) | (({listener} & 255) << 8), bytes([127, 0, 0, 1]))
print('connect', fd >= 0, libc.connect(fd, addr, len(addr)))
"""
    r = run_python(code, SandboxLimits())
    assert r.ok and r.output.strip() == "connect True -1", r.output
    hook_only = run_python(code, SandboxLimits(network="hook"))
    assert hook_only.ok and hook_only.output.strip() == "connect True 0", hook_only.output


# ---------------------------------------------------------------- gsm8k_calculator

def test_gsm8k_calculator_episode_rules():
    make = get_environment("gsm8k_calculator")
    record = {"question": "Tom has 3 boxes of 4 apples. How many apples?",
              "answer": "3 boxes * 4 = 12\n#### 12"}
    env = make(record, max_tool_calls=2)
    assert env.tools is None and "<tool_call>" in env.reset()[0]["content"]
    wrong = env.step("It is \\boxed{13}.")
    assert wrong.done and wrong.reward == 0.0
    env.reset()
    bad = env.step('<tool_call>{"name": "python", "arguments": {"code": }}</tool_call>')
    assert not bad.done and bad.info["tool_errors"] == 1
    assert bad.messages[0]["content"].startswith("error: tool call 1: invalid JSON")
    unknown = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert "unknown tool 'search'" in unknown.messages[0]["content"]
    assert unknown.info["tool_errors"] == 1
    over = env.step(call("print(1)"))                     # a third call: past max_tool_calls
    assert over.done and over.reward == 0.0 and over.info["tool_limit"] == 1
    env = make({"prompt": "q", "answer": "#### 12"}, tools_in_template=True)
    assert env.tools[0]["function"]["name"] == "python"
    assert "<tool_call>" not in env.reset()[0]["content"]
    assert env.step("#### 12").reward == 1.0
    with pytest.raises(EnvError, match="record field 'answer'"):
        make({"question": "q"})
    with pytest.raises(EnvError, match="timeout_s"):
        make(record, timeout_s=0)


def test_sandbox_sees_no_caller_environment(monkeypatch):
    monkeypatch.setenv("RLFLOW_TEST_SECRET", "s3cret")
    import os

    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    monkeypatch.setenv("PYTHONPATH", repo)
    r = run_python("import os, sys\nprint(sorted(os.environ))\nprint(os.getcwd())\n"
                   f"print({repo!r} in sys.path)")
    names, cwd, repo_on_path = r.output.splitlines()
    assert r.ok and "RLFLOW_TEST_SECRET" not in names and "s3cret" not in r.output
    assert set(eval(names)) <= {"PATH", "HOME", "LANG", "PYTHONIOENCODING", "OMP_NUM_THREADS",
                                "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LC_CTYPE"}
    assert "rlflow-python-tool-" in cwd and repo_on_path == "False"
