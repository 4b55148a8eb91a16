"""Drives a running Fathom environment server with OpenEnv's own Python client.

Run by env/tests/openenv.rs as `python drive.py BASE_URL PLAN.json MAX_SESSIONS`; prints one
JSON object with what it saw, which the Rust test checks. It uses only the `openenv`
package's public client (`GenericEnvClient`, over WebSocket, sync and async), its running-
server validator, and `jsonschema` (an `openenv` dependency) to check every action,
observation and state against the server's own `/schema`.

The plan holds, per episode, the reset parameters and the actions of Fathom's scripted
expert, computed in-process by the Rust test; the same actions must produce the same
conversation and reward through the server.
"""

import asyncio
import json
import sys

import jsonschema
import requests
from openenv.cli._validation import validate_running_environment
from openenv.core import GenericEnvClient


def main() -> None:
    url, plan_path, max_sessions = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    out = {"problems": []}

    out["validation"] = validate_running_environment(url, timeout_s=30)

    schemas = requests.get(f"{url}/schema", timeout=30).json()
    validators = {
        kind: jsonschema.Draft202012Validator(schema) for kind, schema in schemas.items()
    }

    # The schemas must reject what the server never sends, or checking against them proves
    # nothing.
    for kind, wrong in [
        ("observation", {"messages": 5}),
        ("observation", {"step": {"assistant": "x", "surprise": 1}}),
        ("action", {"code": 1}),
        ("action", {"cod": "x"}),
        ("state", {"step_count": "one"}),
    ]:
        if not list(validators[kind].iter_errors(wrong)):
            out["problems"].append(f"the {kind} schema accepts {wrong}")

    def check(kind, value, where):
        for error in list(validators[kind].iter_errors(value))[:3]:
            path = "/".join(str(p) for p in error.absolute_path)
            out["problems"].append(f"{where}: {kind} at /{path}: {error.message[:300]}")

    # Expert episodes through the synchronous client.
    episodes = []
    with GenericEnvClient(base_url=url, message_timeout_s=120).sync() as env:
        for i, episode in enumerate(plan["episodes"]):
            result = env.reset(**episode["reset"])
            check("observation", result.observation, f"episode {i} reset")
            first_text = result.observation["text"]
            for j, action in enumerate(episode["actions"]):
                check("action", action, f"episode {i} action {j}")
                result = env.step(action)
                check("observation", result.observation, f"episode {i} step {j}")
            state = env.state()
            check("state", state, f"episode {i} state")
            episodes.append(
                {
                    "first_text": first_text,
                    "done": result.done,
                    "reward": result.reward,
                    "messages": result.observation["messages"],
                    "score": result.observation["score"],
                    "trajectory_steps": len(result.observation["trajectory"]["steps"]),
                    "state": state,
                }
            )
    out["episodes"] = episodes

    # A caller-supplied document, question and expected answer (as OpenEnv's REPL
    # environment takes them), through the asynchronous client.
    async def custom():
        async with GenericEnvClient(base_url=url) as env:
            first = await env.reset(
                context="Ledger. The vault code is 4417. End.",
                task_prompt="What is the vault code?",
                expected_answer="4417",
                episode_id="py-custom",
            )
            code = await env.step({"code": "print(context[26:30])"})
            final = await env.step({"answer": "4417"})
            for where, r in [("custom reset", first), ("custom code", code), ("custom answer", final)]:
                check("observation", r.observation, where)
            return {
                "episode_id": first.observation["episode_id"],
                "output": code.observation["text"],
                "done": final.done,
                "reward": final.reward,
                "correct": final.observation["score"]["correct"],
            }

    out["custom"] = asyncio.run(custom())

    # Errors arrive as OpenEnv's RuntimeError with the code; the session stays usable.
    with GenericEnvClient(base_url=url).sync() as env:
        env.reset(seed=11)
        try:
            env.step({"code": 5})
            out["bad_action"] = "accepted"
        except RuntimeError as e:
            out["bad_action"] = str(e)
        try:
            env.reset(split="eval", index=100000)
            out["bad_reset"] = "accepted"
        except RuntimeError as e:
            out["bad_reset"] = str(e)
        env.reset(seed=12)
        out["after_errors"] = env.step({"code": "print('after')"}).observation["text"]

    # A full server refuses the next client at once, with OpenEnv's capacity code.
    clients = []
    try:
        for _ in range(max_sessions):
            c = GenericEnvClient(base_url=url).sync()
            c.connect()
            c.reset(seed=1)
            clients.append(c)
        extra = GenericEnvClient(base_url=url, message_timeout_s=30).sync()
        try:
            extra.connect()
            extra.reset(seed=2)
            out["capacity"] = "accepted"
        except (RuntimeError, ConnectionError) as e:
            out["capacity"] = str(e)
        finally:
            try:
                extra.close()
            except Exception:
                pass
    finally:
        for c in clients:
            c.close()

    # Once the others have closed, a new client gets in again.
    with GenericEnvClient(base_url=url).sync() as env:
        out["after_capacity"] = env.reset(seed=3).observation["task_id"]

    print(json.dumps(out))


if __name__ == "__main__":
    main()
