"""Environment doubles for the episode tests, importable in environment worker processes
(``"episode_envs:make_flaky"``; no JAX imports)."""

import time

from rlflow.envs import EnvStep


class Flaky:
    """``step("ok")`` answers, ``step("raise")`` raises, ``step("hang")`` never returns."""

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, assistant):
        if assistant == "raise":
            raise RuntimeError("environment bug")
        if assistant == "hang":
            while True:
                time.sleep(1)
        return EnvStep(messages=[{"role": "user", "content": "again"}])


def make_flaky(record, **options):
    return Flaky()


class Tally:
    """An environment with state: it keeps the running count of the words of the assistant's
    turns, answers each turn with that count (a user message), and ends the episode at
    its third turn with reward ``count / 10``. Its answers depend on every turn before, so
    an episode resumed with a fresh environment must replay its turns to continue alike."""

    def __init__(self):
        self.count, self.turns = 0, 0

    def reset(self):
        return [{"role": "user", "content": "count"}]

    def step(self, assistant):
        self.turns += 1
        self.count += len(assistant.split())
        if self.turns >= 3:
            return EnvStep(done=True, reward=self.count / 10)
        return EnvStep(messages=[{"role": "user", "content": str(self.count)}])


def make_tally(record, **options):
    return Tally()
