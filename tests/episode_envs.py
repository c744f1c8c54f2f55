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
