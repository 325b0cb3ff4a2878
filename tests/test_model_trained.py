"""The embedded default ``tiny`` is the trained model: it answers in readable text, its weights and loss are
the shipped ones, and the seeded random model stays available as ``tiny-random``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvpool.model.loader import load_model
from kvpool.model.tiny import TRAINED_WEIGHTS, build_tiny
from kvpool.model.tokenizer import TINY_TOKENIZER, ByteTokenizer, HFTokenizer, load_tokenizer

TRAINING_LOG = TRAINED_WEIGHTS.with_name("tiny_training.json")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def test_tiny_is_trained_and_tiny_random_is_the_seeded_model(tiny) -> None:
    random = load_model("tiny-random")
    assert random.fingerprint() == build_tiny().fingerprint()
    assert tiny.fingerprint() != random.fingerprint() and tiny.config == random.config


def test_tiny_speaks_bpe_and_the_seeded_models_speak_bytes(tiny) -> None:
    tok = load_tokenizer("tiny", tiny.config)
    assert isinstance(tok, HFTokenizer) and tok.bos_id == tiny.config.bos_token_id
    text = "def __init__(self, x):\n    return 'héllo 🙂'\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and len(ids) < 0.6 * len(text.encode()) and max(ids) < tiny.config.vocab_size
    assert tok.decode(ids) == text  # byte-level: every text round-trips
    assert isinstance(load_tokenizer("tiny-random", tiny.config), ByteTokenizer)
    assert isinstance(load_tokenizer(None, tiny.config), ByteTokenizer)


def test_a_split_multibyte_character_decodes_to_a_held_back_replacement(tiny) -> None:
    tok = load_tokenizer("tiny", tiny.config)
    ids = tok.encode("🙂")[1:]
    assert len(ids) > 1  # the emoji is not one merge: its bytes arrive over several tokens
    assert tok.decode(ids[:1]).endswith("\ufffd") and tok.decode(ids) == "🙂"


def test_the_trained_model_answers_in_readable_text(tiny) -> None:
    tok = load_tokenizer("tiny", tiny.config)
    for prompt in ("def __init__(self, ", "import os\nimport sys\n\n\ndef main():\n    "):
        ids = tiny.generate(tok.encode(prompt), 32, eos_ids=())
        text = tok.decode(ids)
        assert "\ufffd" not in text, repr(text)
        printable = sum(c.isprintable() or c in "\n\t" for c in text) / len(text)
        assert printable > 0.95 and sum(c.isalpha() for c in text) > 12, repr(text)


def test_the_shipped_training_log_states_the_loss() -> None:
    log = json.loads(TRAINING_LOG.read_text())
    loss = log["validation_loss_nats_per_byte"]
    assert loss["final"] < 1.5  # per byte, comparable across tokenizers (the byte-level model: 1.42)
    per_token = log["validation_loss_nats_per_token"]
    assert per_token["final"] < 0.6 * per_token["initial"] and log["bytes_per_token"] > 2
    assert log["seed"] == 0 and len(log["corpus_sha256"]) == 64
    assert TRAINED_WEIGHTS.stat().st_size + TINY_TOKENIZER.stat().st_size < 25 * 2**20
    notice = (Path(TRAINED_WEIGHTS).parent / "NOTICE").read_text()
    assert "Python Software Foundation" in notice
