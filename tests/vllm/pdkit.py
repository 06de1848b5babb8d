"""Helpers of the vLLM tests: engine subprocesses, the tiny model, configs, output comparisons."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ENGINE_RUN = HERE / "helpers" / "engine_run.py"
PROMPT_LEN = 200  # 6 full blocks of 32 and a partial one
BLOCK = 32
ENGINE_TIMEOUT = 400  # one engine subprocess, start to end (2 busy cores start an engine in ~30-90 s)


def engine_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("PYTHONHASHSEED", None)  # block keys must not depend on it
    return env


def make_tiny_llama(path: Path, max_positions: int = 512, *, layers: int = 2, kv_heads: int = 2) -> Path:
    """A 2-layer Llama (hidden 256, 4 heads, 2 KV heads, head_dim 64, vocab 2048; 2 KiB of KV a token)
    plus a word-level tokenizer (``w<N>`` is token N), saved to ``path``. Seeded: the same weights every
    time (whatever ``max_positions``, the longest sequence it takes). ``layers`` and ``kv_heads`` make its
    KV larger (``layers * kv_heads * 512`` bytes a token; as many query heads as KV heads, at least 4)."""
    code = f"""
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
torch.manual_seed(0)
cfg = LlamaConfig(num_hidden_layers={layers}, hidden_size=256, intermediate_size=512, num_attention_heads={max(4, kv_heads)},
                  num_key_value_heads={kv_heads}, head_dim=64, vocab_size=2048, max_position_embeddings={max_positions},
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
LlamaForCausalLM(cfg).save_pretrained({str(path)!r})
vocab = {{"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{{f"w{{i}}": i for i in range(4, 2048)}}}}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.decoder = decoders.WordPiece(prefix="##")
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                               pad_token="<pad>", model_max_length={max_positions})
fast.chat_template = "{{% for m in messages %}}{{{{ m['content'] }}}} {{% endfor %}}"
fast.save_pretrained({str(path)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=engine_env(), timeout=300)
    return path


class Engine:
    """One ``engine_run.py`` subprocess; :meth:`result` waits for it and returns its JSON. ``prefix`` runs it
    elsewhere (an emulated host's ``Host.prefix()``); ``env`` adds to :func:`engine_env`. Every engine a test
    started is killed when it ends (``conftest.py``), whatever it left waiting (a gated consumer, a held
    producer)."""

    started: list[Engine] = []

    def __init__(self, workdir: Path, name: str, spec: dict[str, Any], *, prefix: Sequence[str] = (),
                 env: dict[str, str] | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.spec_path, self.out_path, self.log_path = (workdir / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
        self.spec_path.write_text(json.dumps(spec))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(ENGINE_RUN), str(self.spec_path), str(self.out_path)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**engine_env(), **(env or {})}, cwd=workdir,
            start_new_session=True,  # its group: a kill reaches the engine's worker processes too (tensor parallel)
        )  # fmt: skip
        self.started_at = time.monotonic()
        Engine.started.append(self)

    def result(self, timeout: float = ENGINE_TIMEOUT) -> dict[str, Any]:
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started_at)))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            self.kill()  # its group: whatever the engine left running (all of it, on a timeout)
            self._log.close()
        if rc != 0:
            tail = self.log_path.read_text()[-6000:]
            pytest.fail(f"engine {self.name!r} exited {rc}; log tail:\n{tail}")
        return json.loads(self.out_path.read_text())

    def kill(self) -> None:
        """The engine and every process it started (its group), gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def gated(gate: Path) -> dict[str, Any]:
    """Spec entries for an engine that starts now but sends its requests only once :func:`open_gate` (or a
    producer's ``publish``) has written ``gate``: a consumer's start (mostly importing vLLM, on one core)
    overlaps its producer's run instead of following it."""
    return {"params_from": str(gate), "hold_s": ENGINE_TIMEOUT}


def open_gate(gate: Path, params: dict[str, Any] | None = None) -> None:
    """Let the engine waiting on ``gate`` (:func:`gated`) send its requests, with ``params``' entries as
    their ``kv_transfer_params`` (none by default: a store's consumer finds the blocks by their keys)."""
    tmp = gate.with_name(gate.name + ".tmp")
    tmp.write_text(json.dumps(params or {}))
    os.replace(tmp, gate)


def kv_config(connector: str, role: str, extra: dict[str, Any], **more: Any) -> dict[str, Any]:
    """A KVTransferConfig dict; ``connector`` is ``kvbridge.X`` (plugin) or ``X`` (module path)."""
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    if not connector.startswith("kvbridge."):
        cfg["kv_connector_module_path"] = "kvbridge"
    cfg.update(more)
    return cfg


def assert_same_output(got: dict[str, Any], want: dict[str, Any], *, atol: float = 1e-4) -> None:
    """Greedy tokens equal token for token, and each token's logprob within ``atol``."""
    assert got["finish_reason"] == "length", got
    assert got["tokens"] == want["tokens"], f"tokens differ: {got['tokens']} vs baseline {want['tokens']}"
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])]
    assert len(got["logprobs"]) == len(want["logprobs"]) and max(diffs) <= atol, f"logprobs differ by {max(diffs)}"


def output_differs(got: dict[str, Any], want: dict[str, Any], *, atol: float = 1e-3) -> bool:
    if got["tokens"] != want["tokens"]:
        return True
    return max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) > atol
