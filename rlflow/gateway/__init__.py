"""The agent gateway (issue 52): an OpenAI-compatible HTTP endpoint in front of the sampler
that records each agent session as a multi-turn episode (token in, token out).

Modules: :mod:`~rlflow.gateway.sessions` (episodes, prefix reuse, branches),
:mod:`~rlflow.gateway.openai_api` (request checks, response shapes),
:mod:`~rlflow.gateway.tool_calls` (model tool-call formats <-> OpenAI ``tool_calls``),
:mod:`~rlflow.gateway.calls` (generation calls through the continuous batcher),
:mod:`~rlflow.gateway.server` (the HTTP server), :mod:`~rlflow.gateway.rollouts` (sessions of
leased prompts -> group records for the learner), :mod:`~rlflow.gateway.agents` (the agent
runner process).
"""
