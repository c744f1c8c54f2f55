"""Agent functions for the gateway's agent-runner tests (written against the openai client
only): ``task["prompt"]`` picks the behaviour."""

import time


def agent(client, task):
    """"ok": three calls (history re-sent each time), reward 1 + prompt_id / 1000;
    "crash": one call, then an exception; "hang": one call, then sleeps past the gateway's
    session timeout (the session expires)."""
    messages = [{"role": "user", "content": f"task {task['prompt_id']}"}]
    for k in range(3 if task["prompt"] == "ok" else 1):
        r = client.chat.completions.create(model="policy", messages=messages)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"step {k}"})
    if task["prompt"] == "crash":
        raise RuntimeError("the agent crashed")
    if task["prompt"] == "hang":
        time.sleep(600.0)          # the runner is stopped at the end of the test
    return 1.0 + task["prompt_id"] / 1000
