"""NVIDIA Dynamo's own Python packages (ai-dynamo, ai-dynamo-runtime), installed by scripts/dynamo-wheels.sh
into the cache, and a model directory small enough to write by hand for Dynamo's mocker engine and its
frontend (a word-level tokenizer and a llama-shaped config)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster.components import cache_dir

REPO = Path(__file__).resolve().parents[2]
MOCKER_WORKER = REPO / "examples" / "reference_worker" / "dynamo_mocker_worker.py"
WORDS = ("the", "a", "worker", "restored", "checkpoint", "snapshot", "answers", "pod", "node", "fast")


def dynamo_version() -> str:
    text = (REPO / "scripts" / "versions.env").read_text()
    found = re.search(r"^DYNAMO_VERSION=(\S+)", text, re.MULTILINE)
    assert found, "scripts/versions.env pins no DYNAMO_VERSION"
    return found.group(1)


def dynamo_site() -> Path:
    """The site-packages the pinned wheels are installed in; fails with the fix when they are not."""
    venv = cache_dir() / f"dynamo-{dynamo_version()}"
    if not (venv / ".complete").is_file():
        pytest.fail(
            f"NVIDIA Dynamo {dynamo_version()} is not installed in {venv}: run scripts/test.sh "
            "(scripts/dynamo-wheels.sh installs it)",
            pytrace=False,
        )
    return venv / "lib" / "python3.11" / "site-packages"


def dynamo_env(site: Path, **extra: str) -> dict[str, str]:
    """The environment of a host process that runs Dynamo's code from `site`."""
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", **extra}


def pod_worker_env(site: Path, kv: Path, system_port: int) -> dict[str, str]:
    """The environment of Dynamo's worker in a pod of the worker image: Dynamo's packages from ``site``
    (the host's, mounted at the same path), file discovery in ``kv``, its system server (the worker's own
    metrics and health, labelled with its worker_id) on ``system_port``."""
    return {
        "PYTHONPATH": str(site),
        "HOME": "/tmp",
        "HF_HUB_OFFLINE": "1",
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(kv),
        "DYN_SYSTEM_PORT": str(system_port),
    }


def run_dynamo_python(site: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=dynamo_env(site), capture_output=True, text=True, check=False
    )


def write_tiny_model(directory: Path, name: str = "tiny-mocker") -> Path:
    """A model directory the mocker serves and the frontend tokenizes with: the words above, one token
    each, plus the special tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate([*specials, *WORDS])}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": vocab[t],
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for t in specials
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    files = {
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "model_max_length": 2048,
            # The frontend builds its prompt formatter from it, for completions too.
            "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
        },
        "config.json": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": len(vocab),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "bos_token_id": vocab["<s>"],
            "eos_token_id": vocab["</s>"],
            "torch_dtype": "bfloat16",
            "_name_or_path": name,
        },
        "generation_config.json": {"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"]},
    }
    for file, content in files.items():
        (directory / file).write_text(json.dumps(content, indent=1))
    return directory
