"""The agent runner: a process that runs the user's agent function for each session the run
hands out (``gateway.agent``), ``gateway.agent_threads`` sessions at a time.

The agent is a plain function written against the official ``openai`` client::

    def agent(client: openai.OpenAI, task: dict) -> float | None: ...

``client`` is bound to the session (its base URL is ``.../s/<session>/v1``, its key the
run's); ``task`` is the prompt's record (``{"prompt_id", "prompt", "answer"}``). The value it
returns is the session's reward (None: 0). An exception ends the session as failed (the run
goes on; the sample is marked ``failed``); an agent that hangs is expired by the gateway
after ``gateway.session_timeout_s`` idle seconds.

The runner gets the gateway's URL and key from its environment (``RLFLOW_GATEWAY_URL``,
``RLFLOW_GATEWAY_KEY``: never on the command line or on disk), the agent reference from
``RLFLOW_GATEWAY_AGENT`` (``module:function`` or ``path/to/file.py:function``) and the
thread count from ``RLFLOW_GATEWAY_AGENT_THREADS``. It stops when the gateway stops answering
(``MAX_MISSES`` refused connections in a row) or its parent process is gone.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger("rlflow.gateway.agents")

ENV_URL, ENV_KEY = "RLFLOW_GATEWAY_URL", "RLFLOW_GATEWAY_KEY"
ENV_AGENT, ENV_THREADS = "RLFLOW_GATEWAY_AGENT", "RLFLOW_GATEWAY_AGENT_THREADS"
MAX_MISSES = 20
CALL_TIMEOUT_S = 600.0


def _post(url: str, key: str, body: dict, timeout: float = 60.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = r.read()
        return r.status, (json.loads(data) if data else None)


def _worker(url: str, key: str, fn, stop: threading.Event) -> None:
    import openai

    misses = 0
    while not stop.is_set():
        try:
            status, got = _post(f"{url}/rlflow/v1/next", key, {"wait_s": 1.0})
            misses = 0
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            misses += 1
            if misses >= MAX_MISSES:
                log.info("the gateway at %s stopped answering (%s); the runner stops", url, e)
                stop.set()
                return
            time.sleep(0.25)
            continue
        if status != 200 or not got:
            continue
        client = openai.OpenAI(base_url=got["base_url"], api_key=key, max_retries=0,
                               timeout=CALL_TIMEOUT_S)
        try:
            reward = fn(client, got["task"])
            end = {"reward": None if reward is None else float(reward)}
        except Exception as e:  # noqa: BLE001 - the session fails, the runner goes on
            end = {"error": f"{type(e).__name__}: {e}"[:2000]}
        finally:
            client.close()
        try:
            _post(f"{url}/rlflow/v1/sessions/{got['session']}/end", key, end)
        except urllib.error.HTTPError as e:       # e.g. the session expired meanwhile
            log.warning("ending session %s: HTTP %d", got["session"], e.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass


def main() -> int:
    from rlflow.system import plugins

    logging.basicConfig(level=logging.INFO, format="%(asctime)s agents %(message)s")
    url, key = os.environ[ENV_URL], os.environ.pop(ENV_KEY)
    fn = plugins.resolve(os.environ[ENV_AGENT])
    # openai 2.x imports its resources on the first ``client.chat`` (about 2 s on a busy
    # host): done here, before any session is handed out, not against a session's idle timeout
    import openai.resources.chat  # noqa: F401
    import openai.resources.completions  # noqa: F401
    threads = int(os.environ.get(ENV_THREADS, "4"))
    parent = os.getppid()
    stop = threading.Event()
    workers = [threading.Thread(target=_worker, args=(url, key, fn, stop), daemon=True)
               for _ in range(threads)]
    for w in workers:
        w.start()
    while not stop.is_set() and os.getppid() == parent:
        stop.wait(1.0)
    stop.set()
    return 0


def start_runner(url: str, key: str, agent: str, threads: int) -> subprocess.Popen:
    """Start the runner process (``python -m rlflow.gateway.agents``); the key goes in its
    environment only."""
    env = dict(os.environ, **{ENV_URL: url, ENV_KEY: key, ENV_AGENT: agent,
                              ENV_THREADS: str(int(threads)),
                              "JAX_PLATFORMS": "cpu"})
    return subprocess.Popen([sys.executable, "-m", "rlflow.gateway.agents"], env=env,
                            stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main())
