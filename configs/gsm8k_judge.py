"""GRPO on GSM8K rewarded by the answer and by an LLM judge served over HTTP (issue 44 item 3):
``--model.path`` is required, and a judge must be served.

    # the judge: any OpenAI-compatible server, e.g. vLLM on this host
    vllm serve Qwen/Qwen2.5-7B-Instruct --port 8000
    rlflow train --config configs/gsm8k_judge.py --model.path ~/models/Qwen2.5-0.5B-Instruct

Everything of ``configs/gsm8k.py`` (data, template, sampler, learner, eval), with the reward
``1.0 x math_verify + 0.5 x judge``: ``math_verify`` pays the right final number, the judge
(``reward.judge``, :class:`rlflow.config.JudgeConfig`) grades the worked solution against the
reference solution from 0 to 10 (the template below), read from its reply's last ``Score: <n>``
and scaled to [0, 1]. The judge is asked from the sampler while it decodes (8 requests in
flight, 60 s per try, 3 retries with backoff); a sample the judge cannot grade scores 0 there
and is marked failed (``learner.on_failed_sample``: left out of the loss and the baseline).

Judge endpoint and model: ``$RLFLOW_JUDGE_URL`` (default
``http://127.0.0.1:8000/v1/chat/completions``) and ``$RLFLOW_JUDGE_MODEL`` (default
``Qwen/Qwen2.5-7B-Instruct``), or ``--reward.judge.url`` / ``--reward.judge.model``. A hosted
API: ``--reward.judge.api-key-env OPENAI_API_KEY`` (the key stays in that variable; it is
sent as ``Authorization: Bearer <key>`` and never written to the run folder).
"""

import dataclasses
import os

from rlflow.config import JudgeConfig, config_module

JUDGE_TEMPLATE = (
    "You are grading a student's solution to a math word problem.\n\n"
    "Problem (as the student saw it):\n{question}\n\n"
    "Reference solution (its final answer follows ####):\n{reference}\n\n"
    "Student's solution:\n{completion}\n\n"
    "Grade the student's solution from 0 to 10: 10 when the reasoning is correct and the final "
    "answer equals the reference, lower for each wrong step, 0 when the final answer is wrong "
    "or missing. Explain briefly, then end with one line: Score: <n>")


def _gsm8k():
    here = os.path.dirname(os.path.abspath(__file__))
    return config_module(os.path.join(here, "gsm8k.py")).config()


def config():
    cfg = _gsm8k()
    judge = JudgeConfig(
        url=os.environ.get("RLFLOW_JUDGE_URL", "http://127.0.0.1:8000/v1/chat/completions"),
        model=os.environ.get("RLFLOW_JUDGE_MODEL", "Qwen/Qwen2.5-7B-Instruct"),
        prompt_template=JUDGE_TEMPLATE, max_tokens=512, temperature=0.0,
        max_concurrency=8, timeout_s=60.0, max_retries=3)
    reward = dataclasses.replace(cfg.reward, functions=("math_verify", "judge"),
                                 weights=(1.0, 0.5), judge=judge)
    return dataclasses.replace(cfg, name="gsm8k_judge", reward=reward)
