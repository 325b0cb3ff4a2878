"""The embedded default ``tiny`` is the trained model: it answers in readable text, its weights and loss are
the shipped ones, and the seeded random model stays available as ``tiny-random``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvpool.model.loader import load_model
from kvpool.model.tiny import TRAINED_WEIGHTS, build_tiny
from kvpool.model.tokenizer import ByteTokenizer

TRAINING_LOG = TRAINED_WEIGHTS.with_name("tiny_training.json")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def test_tiny_is_trained_and_tiny_random_is_the_seeded_model(tiny) -> None:
    random = load_model("tiny-random")
    assert random.fingerprint() == build_tiny().fingerprint()
    assert tiny.fingerprint() != random.fingerprint() and tiny.config == random.config


def test_the_trained_model_answers_in_readable_text(tiny) -> None:
    tok = ByteTokenizer(tiny.config.vocab_size, tiny.config.bos_token_id)
    for prompt in ("def __init__(self, ", "import os\nimport sys\n\n\ndef main():\n    "):
        ids = tiny.generate(tok.encode(prompt), 48, eos_ids=())
        assert all(3 <= i < 259 for i in ids), ids  # byte tokens only
        text = bytes(i - 3 for i in ids).decode("utf-8")  # valid UTF-8, no replacement needed
        printable = sum(c.isprintable() or c in "\n\t" for c in text) / len(text)
        assert printable > 0.95 and sum(c.isalpha() for c in text) > 12, repr(text)


def test_the_shipped_training_log_states_the_loss() -> None:
    log = json.loads(TRAINING_LOG.read_text())
    loss = log["validation_loss_nats_per_byte"]
    assert loss["final"] < 0.5 * loss["initial"] and loss["final"] < 2.0
    assert log["seed"] == 0 and len(log["corpus_sha256"]) == 64
    assert TRAINED_WEIGHTS.stat().st_size < 25 * 2**20
    notice = (Path(TRAINED_WEIGHTS).parent / "NOTICE").read_text()
    assert "Python Software Foundation" in notice
