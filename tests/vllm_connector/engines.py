"""Drive ``engine.py`` processes (one vLLM engine each) and a real kvpool store for the connector tests
and the bench. Every wait has a deadline; an engine's stderr goes to a log file beside the test's."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENGINE = Path(__file__).with_name("engine.py")
MARK = "KVPOOL-ENGINE "  # engine.py's answer lines (vLLM logs on the same stdout)
START_DEADLINE_S = 180.0
RUN_DEADLINE_S = 120.0


class EngineError(RuntimeError):
    """An engine process died, printed something unexpected, or missed its deadline."""


class Engine:
    """One engine process. It boots as soon as it is constructed and nothing waits for it until
    ``wait_ready()`` or the first ``run(prompts, ...)``, so a test can boot several engines at once;
    ``run`` sends a command and waits for its answer line."""

    def __init__(self, spec: dict[str, Any], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._start_deadline = time.monotonic() + START_DEADLINE_S
        self._ready: dict[str, Any] | None = None

    def wait_ready(self) -> dict[str, Any]:
        """The engine's readiness answer, waited for once, within START_DEADLINE_S of its start."""
        if self._ready is None:
            self._ready = self._next(max(0.0, self._start_deadline - time.monotonic()))
        return self._ready

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._lines.put(line[len(MARK) :])
            else:  # vLLM logs on stdout: keep it beside stderr in the engine's log
                self._log.write(line)
                self._log.flush()
        self._lines.put(None)

    def _next(self, deadline_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=deadline_s)
        except queue.Empty:
            raise EngineError(f"engine gave no answer in {deadline_s} s (log: {self.log_path})") from None
        if line is None:
            raise EngineError(f"engine exited (code {self.proc.poll()}); log: {self.log_path}")
        obj, _ = json.JSONDecoder().raw_decode(line)  # anything after the object is someone else's log
        return obj

    def run(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        salt: str | None = None,
        deadline_s: float = RUN_DEADLINE_S,
    ) -> dict[str, Any]:
        self.wait_ready()
        assert self.proc.stdin is not None
        cmd = {"prompts": prompts, "max_tokens": max_tokens, "salt": salt}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._next(deadline_s)

    def request_exit(self) -> None:
        """Close stdin: the engine finishes its last answer and shuts down; ``close`` waits for that."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self) -> None:
        self.request_exit()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def close_all(*engines: Engine) -> None:
    """Shut several engines down at once (each takes seconds): all stdins closed, then each waited for."""
    for e in engines:
        e.request_exit()
    for e in engines:
        e.close()


def kvpool_spec(model: Path, master: str, role: str, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "connector": {"role": role, "master": master, **extra}}


def prompts_of(lengths: list[int], seed: int, vocab: int = 512) -> list[list[int]]:
    """Deterministic token prompts (ids 1..vocab-1) of the given lengths."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
