"""`kvpool generate --json` as a user runs it: a real subprocess, on the tiny model and on a checkpoint
directory written by transformers' `save_pretrained` (greedy output must equal transformers' own). Refused
input is checked in this process (``main(argv)``): an exit status and a message need no fresh interpreter."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.usefixtures("torch_deterministic")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", "generate", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_tiny_json():
    from kvpool.model.loader import load_model
    from kvpool.model.tokenizer import load_tokenizer

    p = _run("--model", "tiny", "--prompt-ids", "1,40,41,42", "--max-tokens", "6", "--json", "--ignore-eos")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["prompt_ids"] == [1, 40, 41, 42] and len(out["output_ids"]) == 6 and "text" in out
    model = load_model("tiny")  # the trained default
    assert out["output_ids"] == model.generate([1, 40, 41, 42], 6, eos_ids=())
    assert out["fingerprint"] == model.fingerprint().hex()
    p = _run("--prompt", "hello", "--max-tokens", "3", "--json")  # tiny speaks its BPE
    assert p.returncode == 0 and json.loads(p.stdout)["prompt_ids"] == load_tokenizer(
        "tiny", model.config
    ).encode("hello")
    p = _run("--model", "tiny-random", "--prompt", "hello", "--max-tokens", "3", "--json")  # bytes
    assert p.returncode == 0 and json.loads(p.stdout)["prompt_ids"] == [1, *(b + 3 for b in b"hello")]


def _exit_status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """(exit status, stderr) of ``kvpool generate ARGS`` run in this process; any exception it lets out
    fails the test, as a traceback on a user's terminal would."""
    from kvpool.commands.main import main

    try:
        status = main(["generate", *args])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    return status, capsys.readouterr().err


def test_generate_bad_input_exits_2(capsys: pytest.CaptureFixture[str]):
    status, err = _exit_status(capsys, "--prompt-ids", "1,2,99999", "--json")
    assert status == 2 and "outside the vocabulary" in err and "Traceback" not in err
    status, err = _exit_status(capsys, "--prompt-ids", "1,x")
    assert status == 2 and "comma-separated" in err
    status, err = _exit_status(capsys, "--model", "/nonexistent/dir", "--prompt", "hi")
    assert status == 2 and "error:" in err


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="transformers would use Triton")
def test_generate_on_transformers_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    cfg = transformers.KimiLinearConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 3,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        linear_num_heads=2,
        linear_head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = transformers.KimiLinearForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    prompt = [1, 300, 301, 302, 17, 99]
    p = _run(
        "--model",
        str(tmp_path),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-tokens",
        "8",
        "--json",
        "--ignore-eos",
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert out["output_ids"] == ref
