"""A sampler replica's held-out evaluations (``eval.every_steps > 0``).

When the learner's run control names an evaluation (:mod:`rlflow.control.evals`), the replica
submits the held-out prompts (:func:`eval_requests`) to its batcher beside
the training prompts; their finished groups are taken out of what the batcher returns before
the training groups go to the reward workers and the buffer (:meth:`EvalRunner.take`), scored
by this runner's own reward workers (the eval's reward functions), and turned into prompt
records; once all are in, the result goes to the learner with the next status
(:meth:`EvalRunner.take_results`). A NaN/inf reward scores 0 (logged). No evaluation request
enters the prompt ledger, the delivery's leases or the ring buffer.

One policy version per evaluation: while its prompts are decoding (:attr:`EvalRunner.decoding`)
the sampler program holds back newly pulled weights and swaps them in when the last one is
done (:class:`rlflow.sampler.program.SamplerProgram`); the result carries that version.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence

import numpy as np

from rlflow.sampler.delivery import graded_texts

log = logging.getLogger("rlflow.sampler")


def eval_sampling(cfg, index: int):
    """Sampling settings of held-out prompt number ``index`` (its position in the eval
    set): ``eval``'s temperature, top-k, top-p and max tokens, seed
    ``derive_seed(eval.seed, index)`` (the same draws at every version)."""
    from rlflow.config.eval import eval_max_tokens
    from rlflow.control.seeds import derive_seed
    from rlflow.sampler.sampling import SamplingParams

    ev = cfg.eval
    return SamplingParams(temperature=ev.temperature, top_k=ev.top_k, top_p=ev.top_p,
                          max_tokens=eval_max_tokens(cfg), seed=derive_seed(ev.seed, index))


def eval_requests(cfg, prompts: Sequence[Mapping]) -> list:
    """One :class:`rlflow.sampler.requests.Request` per held-out prompt, ``eval.num_samples``
    samples each."""
    from rlflow.sampler.requests import Request

    return [Request(prompt_id=int(p["prompt_id"]),
                    prompt_tokens=np.asarray(p["prompt_tokens"], np.int32),
                    num_samples=cfg.eval.num_samples, sampling=eval_sampling(cfg, i))
            for i, p in enumerate(prompts)]


class EvalRunner:
    """Held-out evaluations of one replica.

    Args:
      cfg: the ``ExperimentConfig`` (its ``eval`` section).
      tokenizer: the run's tokenizer (prompts, decoding completions).
      reasoning: the replica's reasoning parser (``data.reasoning_parser``), or None: the
        reward functions grade the answer part only, as in training.

    Raises (construction):
      as :func:`rlflow.eval.scoring.load_eval_prompts`.
    """

    def __init__(self, cfg, tokenizer, reasoning=None):
        from rlflow.config.eval import eval_reward_config
        from rlflow.eval import scoring
        from rlflow.control import programs_common as pc

        self.cfg, self.tokenizer, self.reasoning = cfg, tokenizer, reasoning
        self.prompts = scoring.load_eval_prompts(cfg, tokenizer)
        self.reward_cfg = eval_reward_config(cfg)
        self.threshold = pc.accuracy_threshold(self.reward_cfg)
        self._rewarder = None           # started with the first evaluation
        self.task: Optional[tuple[int, int]] = None     # (requested, version) running
        self._requests: dict[int, tuple] = {}   # id(Request) -> (Request, prompt) decoding
        self._scoring: dict[int, tuple] = {}    # id(Request) -> (Request, group, texts, prompt, unclosed)
        self._records: list = []
        self._results: list = []
        self.evaluations = 0                    # finished on this replica

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def decoding(self) -> bool:
        """Prompts of the running evaluation are still queued or decoding."""
        return bool(self._requests)

    def start(self, requested: int, version: int, batcher) -> None:
        """Submit the held-out prompts for the evaluation ``requested`` to ``batcher``,
        whose weights are (and stay until :attr:`decoding` is False) at ``version``."""
        from rlflow.data.rewarder import Rewarder
        from rlflow.eval import scoring

        if self._rewarder is None:
            self._rewarder = Rewarder(self.reward_cfg, plugins=self.cfg.plugins)
        self.task = (int(requested), int(version))
        self._records = []
        for request, prompt in zip(eval_requests(self.cfg, self.prompts), self.prompts):
            batcher.submit(request)
            self._requests[id(request)] = (request, prompt)
        log.info("held-out evaluation of version %d: %d prompts x %d samples at version %d",
                 requested, self.num_prompts, self.cfg.eval.num_samples, version)

    def take(self, groups) -> list:
        """The groups of a decode step that are not evaluation groups (for the delivery);
        the evaluation's are handed to the reward workers (no wait)."""
        if not self._requests:
            return groups
        rest = []
        for group in groups:
            got = self._requests.pop(id(group.request), None)
            if got is None:
                rest.append(group)
                continue
            request, prompt = got
            texts, finish, unclosed = graded_texts(group, self.tokenizer, self.reasoning)
            key = ("eval", id(request))
            self._scoring[key] = (request, group, texts, prompt, unclosed)
            self._rewarder.submit_group(key, group.prompt_id, texts, prompt["answer"], finish,
                                        prompt["prompt_text"])
        return rest

    def collect(self, timeout: float = 0.0) -> None:
        """File the scored groups as prompt records; a finished evaluation becomes a result
        for :meth:`take_results`."""
        from rlflow.eval import scoring

        if self._rewarder is None or not self._scoring:
            return
        for key, batch in self._rewarder.collect(timeout):
            _, group, texts, prompt, unclosed = self._scoring.pop(key)
            rewards, components = scoring.graded_rewards(batch, unclosed)
            if batch.nonfinite:          # scored 0 (graded_rewards), as a failed call
                log.warning("held-out evaluation: %s; that sample scores 0", batch.nonfinite[0])
            self._records.append(scoring.prompt_record(
                group, texts, rewards, self.threshold, prompt_text=prompt["prompt_text"],
                answer=prompt["answer"], components=components))
        if self.task is not None and not self._requests and not self._scoring:
            requested, version = self.task
            self._results.append({"requested": requested, "version": version,
                                  "records": self._records})
            self.task, self._records = None, []
            self.evaluations += 1

    def metrics(self) -> dict:
        """The held-out evaluations' reward failures on this replica since it started
        (samples scored 0), apart from training's: ``eval/reward_errors/<fn>``,
        ``eval/reward_timeouts/<fn>`` and the served rewards' ``eval/reward_http_<kind>/<name>``
        (:meth:`rlflow.data.rewarder.Rewarder.metrics`, renamed)."""
        if self._rewarder is None:
            return {}
        return {"eval/" + k.replace("reward/", "reward_", 1): float(v)
                for k, v in self._rewarder.metrics().items()}

    @property
    def busy(self) -> bool:
        """An evaluation is decoding or being scored."""
        return self.task is not None

    def take_results(self) -> list:
        """Finished evaluations not yet sent to the learner (emptied by the call)."""
        out, self._results = self._results, []
        return out

    def close(self) -> None:
        if self._rewarder is not None:
            self._rewarder.close()
            self._rewarder = None
