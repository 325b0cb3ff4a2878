"""The checks of scripts/compose_check.sh against a live ``deploy/docker-compose.yml`` stack.

Why a separate driver: the shell script installs Docker and builds the images; this brings the stack up,
checks it the way a user would (the stock ``openai`` client on the published gateway port, Prometheus's
HTTP API, crashes of the storage node and of the master leader) and tears it down, then prints one JSON
line. It needs the ``openai`` and ``httpx`` packages (the project's venv has both) and the docker CLI.

The reference answers come from ``kvpool generate`` in the same image: the chat is rendered to token ids
with the gateway's own template (and turn 1's generated ids for the assistant message, as the gateway's
answer memo does), so greedy decoding must give the gateway's answers token for token.

A crash is SIGKILL to the container's main process from the host: Docker's restart policy restarts a
container whose process died, but deliberately not one stopped with ``docker kill`` (an operator's stop).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROJECT = "kvpool"
MODEL = "tiny"
GATEWAY = "http://127.0.0.1:8000"
PROMETHEUS = "http://127.0.0.1:9090"
MAX_TOKENS = 16
ETCDCTL = ["etcdctl", "--endpoints=http://127.0.0.1:2379"]
LEADER_KEY = "/kvpool/kvpool/leader"  # kvstore/master/ha.py leader_key, the compose file's --ha-group
SYSTEM = (
    "You are the support desk of a storage company. Answer in one short sentence, name the product, "
    "and never promise a delivery date. Products: kvpool store, kvpool gateway, kvpool prefill workers. "
) * 3
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Which product keeps the attention cache between turns?"},
]
FOLLOW_UP = {"role": "user", "content": "And which one answers my HTTP requests?"}

REFERENCE = r"""
import json, subprocess, sys
from kvpool.gateway.chat_template import AnswerMemo, TextCodec, render_chat
from kvpool.gateway.model_info import model_config
from kvpool.gateway.schemas import ChatMessage
from kvpool.model.tokenizer import load_tokenizer

turns, model, max_tokens = json.load(sys.stdin)
config = model_config(model)
codec = TextCodec(load_tokenizer(model, config), config.vocab_size, config.eos_token_id or ())
memo, answers, history = AnswerMemo(), [], []
for turn in turns:
    history += turn
    ids = render_chat(codec, [ChatMessage(**m) for m in history], "ref", memo)
    argv = ["kvpool", "generate", "--model", model, "--prompt-ids", ",".join(map(str, ids)),
            "--max-tokens", str(max_tokens), "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    gen = json.loads(out.stdout)
    memo.put("ref", gen["text"], gen["output_ids"])
    answers.append(gen["text"])
    history.append({"role": "assistant", "content": gen["text"]})
print(json.dumps(answers))
"""


class CheckFailed(Exception):
    """A check of the live stack did not hold; the message says which and what was seen."""


class Stack:
    """The compose project: its command line, containers by service, and their health."""

    def __init__(self, compose: str, image: str, profiles: list[str]) -> None:
        self.cmd = [*shlex.split(compose), "-p", PROJECT, "-f", str(DEPLOY / "docker-compose.yml")]
        for p in profiles:
            self.cmd += ["--profile", p]
        self.image = image
        services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
        self.services = [n for n, s in services.items() if not set(s.get("profiles", [])) - set(profiles)]

    def compose(self, *args: str, timeout: float = 900) -> str:
        r = subprocess.run([*self.cmd, *args], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise CheckFailed(f"{' '.join(args)}: {r.stderr.strip()[-2000:]}")
        return r.stdout

    def kvpool_services(self) -> list[str]:
        """The serving services and etcd: what must be healthy before a request (not the observers)."""
        return [s for s in self.services if s not in ("prometheus", "grafana")]

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).strip()
        if not cid:
            raise CheckFailed(f"no container for {service}")
        return cid

    def inspect(self, service: str) -> dict:
        out = docker("inspect", self.container(service))
        return json.loads(out)[0]["State"]

    def healthy(self, service: str) -> bool:
        state = self.inspect(service)
        health = state.get("Health")
        return state["Running"] and (health is None or health["Status"] == "healthy")

    def wait_healthy(self, services: list[str], timeout_s: float) -> float:
        t0 = time.monotonic()
        while True:
            pending = [s for s in services if not self.healthy(s)]
            if not pending:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                logs = {s: self.compose("logs", "--tail", "15", s)[-1500:] for s in pending}
                raise CheckFailed(f"not healthy after {timeout_s:.0f} s: {pending}; logs: {logs}")
            time.sleep(2)

    def crash(self, service: str) -> int:
        """SIGKILL the service's main process (a crash); returns the restart count before it."""
        state = self.inspect(service)
        subprocess.run(["kill", "-9", str(state["Pid"])], check=True)
        return int(json.loads(docker("inspect", self.container(service)))[0]["RestartCount"])

    def restarts(self, service: str) -> int:
        return int(json.loads(docker("inspect", self.container(service)))[0]["RestartCount"])

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        return {
            kind: docker(*args, "--filter", label, "-q").split()
            for kind, args in (
                ("containers", ["ps", "-a"]),
                ("networks", ["network", "ls"]),
                ("volumes", ["volume", "ls"]),
            )
        }


def docker(*args: str) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise CheckFailed(f"docker {' '.join(args)}: {r.stderr.strip()[-1000:]}")
    return r.stdout


def reference_answers(image: str, turns: list[list[dict]]) -> list[str]:
    r = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "-i",
            "--network",
            "none",
            "--entrypoint",
            "python",
            image,
            "-c",
            REFERENCE,
        ],
        input=json.dumps([turns, MODEL, MAX_TOKENS]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        raise CheckFailed(f"kvpool generate in {image}: {r.stderr.strip()[-1500:]}")
    return json.loads(r.stdout)


def converse(client: openai.OpenAI) -> list[tuple[str, int, int]]:
    """The two-turn conversation; (answer, prompt tokens, cached tokens) per turn."""
    out, messages = [], list(CONVERSATION)
    for turn in (None, FOLLOW_UP):
        if turn is not None:
            messages += [{"role": "assistant", "content": out[-1][0]}, turn]
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        usage = r.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        out.append((r.choices[0].message.content, usage.prompt_tokens, cached or 0))
    return out


def check_chat(client: openai.OpenAI, reference: list[str], label: str, want_hit: bool = True) -> dict:
    turns = converse(client)
    answers = [a for a, _, _ in turns]
    if answers != reference:
        raise CheckFailed(f"{label}: gateway answered {answers}, kvpool generate {reference}")
    if want_hit and turns[1][2] <= 0:
        raise CheckFailed(f"{label}: turn 2 reported no cached tokens ({turns})")
    return {"prompt_tokens": [p for _, p, _ in turns], "cached_tokens": [c for _, _, c in turns]}


def queried_series() -> tuple[set[str], set[str]]:
    """(kvpool series the recording rules and the dashboard query, recorded series the dashboard queries)."""
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "kvpool.json").read_text())
    dash_exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    series = {m for e in exprs + dash_exprs for m in re.findall(r"(?<![:\w])kvpool_[a-z0-9_]+", e)}
    recorded = {m for e in dash_exprs for m in re.findall(r"\b[a-z_]+:kvpool_[a-z0-9_:]+", e)}
    return series, recorded


def prom(path: str, **params: str) -> dict:
    r = httpx.get(PROMETHEUS + path, params=params, timeout=10)
    r.raise_for_status()
    return r.json()["data"]


def check_prometheus(timeout_s: float) -> dict:
    """Every scrape target up, and every series the dashboard and rules use present in Prometheus."""
    series, recorded = queried_series()
    t0 = time.monotonic()
    targets, down, missing = [], ["(not answering)"], sorted(series | recorded)
    while True:
        try:
            targets = prom("/api/v1/targets")["activeTargets"]
            down = sorted(t["scrapeUrl"] for t in targets if t["health"] != "up")
            missing = sorted((series | recorded) - set(prom("/api/v1/label/__name__/values")))
        except httpx.TransportError:
            pass  # still starting (or restarting after a crash: the failure below says so)
        if targets and not down and not missing:
            return {"targets_up": len(targets), "series_checked": len(series | recorded)}
        if time.monotonic() - t0 > timeout_s:
            raise CheckFailed(f"prometheus: targets down {down}, series missing {missing}")
        time.sleep(5)


def leader(stack: Stack) -> str:
    out = stack.compose("exec", "-T", "etcd", *ETCDCTL, "get", "--print-value-only", LEADER_KEY)
    found = [m for m in ("master-0", "master-1") if m in out]
    if len(found) != 1:
        raise CheckFailed(f"cannot tell the master leader from etcd: {out!r}")
    return found[0]


def check_crash(
    stack: Stack, client: openai.OpenAI, service: str, reference: list[str], timeout_s: float
) -> dict:
    """Crash ``service``; the restart policy brings it back; answers stay right and turn 2 hits again."""
    before = stack.restarts(service)
    t0 = time.monotonic()
    stack.crash(service)
    while stack.restarts(service) == before:
        if time.monotonic() - t0 > timeout_s:
            raise CheckFailed(f"{service} was not restarted")
        time.sleep(0.5)
    stack.wait_healthy(stack.kvpool_services(), timeout_s)
    recovered_s = time.monotonic() - t0
    first = check_chat(client, reference, f"after {service} crash", want_hit=False)
    deadline = time.monotonic() + timeout_s
    while True:  # the cache comes back: the same conversation once more hits on turn 2
        again = check_chat(client, reference, f"after {service} crash, again", want_hit=False)
        if again["cached_tokens"][1] > 0:
            break
        if time.monotonic() > deadline:
            raise CheckFailed(f"no hits after {service} came back: {first}, {again}")
        time.sleep(2)
    return {"recovered_s": round(recovered_s, 1), "first": first, "again": again}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compose", default="docker compose", help="compose command line")
    p.add_argument("--image", default="kvpool:0.1.0")
    p.add_argument("--profile", action="append", default=[], help="compose profile to enable")
    p.add_argument("--extra", default="{}", help="JSON object merged into the result (build figures)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per wait")
    args = p.parse_args()
    stack = Stack(args.compose, args.image, args.profile)
    result: dict = json.loads(args.extra)
    checks: dict = {}
    result["checks"] = checks
    ok = False
    try:
        t0 = time.monotonic()
        stack.compose("up", "-d")
        result["up_s"] = round(time.monotonic() - t0, 1)
        result["healthy_s"] = round(
            stack.wait_healthy(stack.kvpool_services(), args.timeout) + result["up_s"], 1
        )
        client = openai.OpenAI(base_url=GATEWAY + "/v1", api_key="none", timeout=120, max_retries=0)
        reference = reference_answers(args.image, [CONVERSATION, [FOLLOW_UP]])
        checks["chat"] = check_chat(client, reference, "chat")
        checks["prometheus"] = check_prometheus(args.timeout)
        checks["node_crash"] = check_crash(stack, client, "node", reference, args.timeout)
        master = leader(stack)
        checks["master_leader_crash"] = {"leader": master} | check_crash(
            stack, client, master, reference, args.timeout
        )
        checks["new_leader"] = leader(stack)
        ok = True
    except (CheckFailed, openai.OpenAIError, httpx.HTTPError, subprocess.TimeoutExpired) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            stack.compose("down", "-v", "--remove-orphans")
            left = stack.leftovers()
            checks["down_clean"] = not any(left.values())
            if not checks["down_clean"]:
                result["leftovers"] = left
        except CheckFailed as exc:
            checks["down_clean"] = False
            result.setdefault("error", str(exc))
    result["ok"] = ok and checks["down_clean"]
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
