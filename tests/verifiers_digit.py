"""A verifiers (0.4, ``verifiers.v1``) environment built in memory for the gateway adapter's
tests (:mod:`rlflow.gateway.verifiers_env`): the taskset plugin ``verifiers_digit`` (import
name; ``tests/`` on ``sys.path``) holds 5 tasks, prompt ``"?"``, hidden digits 0-4; the
reward is the share of the reply's characters that are the task's digit (graded, so that a
random model's group has a spread of rewards and the learner a gradient). Its bundled
harness plays a task in process (one chat call through verifiers' interception endpoint, as
verifiers' ``null`` harness does from a subprocess), so no package download and no network."""

import openai
import verifiers.v1 as vf

from rlflow.gateway.verifiers_env import verifiers_agent

DIGITS = "01234"
PROMPT = "?"
CONFIG = {"agent": {"runtime": {"type": "subprocess"}}}


class DigitData(vf.TaskData):
    answer: str = ""


class DigitTask(vf.Task[DigitData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def share_of_digit(self, task, trace) -> float:
        """The share of the reply's characters that are the hidden digit (0 for none)."""
        reply = str(trace.last_message.content or "").strip()
        return reply.count(task.answer) / len(reply) if reply else 0.0


class DigitTaskset(vf.Taskset[DigitTask, vf.TasksetConfig]):
    def load(self):
        for digit in DIGITS:
            yield DigitTask(DigitData(prompt=PROMPT, answer=digit), self.config.task)


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """One chat call per episode, run in process through ``endpoint`` with ``secret``
    (verifiers' contract for in-process harnesses: a synthetic success result)."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as c:
            await c.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": data.prompt}])
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["DigitTaskset", "ChatHarness"]

#: the gateway agent (``gateway.agent = "tests/verifiers_digit.py:agent"``)
agent = verifiers_agent("verifiers_digit", config=CONFIG)
