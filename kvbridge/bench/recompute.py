"""Transfer vs recompute: is moving a prompt's KV cheaper than prefilling the prompt again?

Recompute is measured on a tiny Llama-like transformer built here in pure torch (no downloads), and
taken from the user for a real model (``--prefill-tps``: prompt tokens per second of prefill). The
transfer cost of each backend is fitted from its measured ``load``/``transfer`` records as
``overhead + tokens * per_token``, which gives the break-even prompt length: the shortest prompt whose
KV is faster to move than to recompute.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from kvbridge.bench.baselines import BASELINES
from kvbridge.bench.cold import evicting
from kvbridge.bench.core import SHAPES, Point, Record, Shape, gbps


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    """A Llama-shaped toy: RMSNorm, rotary attention, SwiGLU MLP."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    intermediate: int = 688
    vocab: int = 1024

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.hidden * 4  # K and V per layer, float32


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.RMSNorm(cfg.hidden), nn.RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, h = x.shape[0], self.heads
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, h, -1).transpose(0, 2).unbind(1)  # [h, n, d] each
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(0, 1).reshape(n, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class TinyLlama(nn.Module):
    """Prefill only: logits of the last position, like a serving engine's prefill step."""

    def __init__(self, cfg: TinyConfig = TinyConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        d = self.cfg.hidden // self.cfg.heads
        pos = torch.arange(tokens.shape[0], dtype=torch.float32)[:, None]
        freqs = pos * (10000.0 ** (-torch.arange(0, d // 2, dtype=torch.float32) / (d // 2)))
        cos, sin = freqs.cos(), freqs.sin()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x[-1]))


def measure_prefill(tokens: int = 512, reps: int = 3, cfg: TinyConfig = TinyConfig()) -> float:
    """Prefill throughput (tokens/s) of :class:`TinyLlama` over a ``tokens``-token prompt, median of ``reps``."""
    torch.manual_seed(0)
    model = TinyLlama(cfg).eval()
    prompt = torch.randint(0, cfg.vocab, (tokens,))
    times = []
    with torch.inference_mode():
        model(prompt)  # warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            model(prompt)
            times.append(time.perf_counter() - t0)
    return tokens / float(np.median(times))


def break_even(overhead_s: float, per_token_s: float, prefill_tps: float) -> float:
    """Prompt length from which moving the KV beats recomputing it (``inf``: never)."""
    margin = 1.0 / prefill_tps - per_token_s
    return overhead_s / margin if margin > 0 else math.inf


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(overhead_s, per_token_s)`` of ``time = overhead + tokens * per_token`` (through 0 with one point)."""
    if len({t for t, _ in points}) < 2:
        tokens, secs = max(points)
        return 0.0, secs / tokens
    slope, icpt = np.polyfit([t for t, _ in points], [s for _, s in points], 1)
    if slope <= 0:
        tokens, secs = max(points)
        return 0.0, secs / tokens
    return max(0.0, float(icpt)), float(slope)


def compare(records: list[Record], prefill_tps: float, tiny_tps: float | None = None, reps: int = 3) -> list[Record]:
    """``recompute`` records: per backend and shape, the transfer time of its largest single-request
    load beside the prefill time of the same tokens at ``prefill_tps``; ``note`` holds the break-even.

    With ``tiny_tps`` (measured by :func:`measure_prefill`), a first record compares a memcpy of the
    tiny model's KV with its measured prefill.
    """
    out: list[Record] = []
    if tiny_tps:
        cfg = TinyConfig()
        shape = Shape("tiny-llama", cfg.layers, cfg.heads, cfg.hidden // cfg.heads, torch.float32)
        point = Point(shape, 512)
        copy = BASELINES["memcpy"](point.nbytes, "load", {}, reps).median
        recompute = point.tokens / tiny_tps
        note = f"tiny-llama measured here: {tiny_tps:,.0f} tok/s; break-even {_even(break_even(0.0, copy / point.tokens, tiny_tps))}"
        out.append(_record("memcpy", point, copy, f"prefill@{tiny_tps:.0f}tok/s", recompute, note))
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        if r.op in ("load", "transfer") and r.measured and r.requests == 1:
            groups.setdefault((r.backend, r.shape), [])
            if all(
                o.tokens != r.tokens or o.block_size != r.block_size or o.ids != r.ids
                for o in groups[(r.backend, r.shape)]
            ):
                groups[(r.backend, r.shape)].append(r)
    for (backend, shape_name), rs in groups.items():
        fit_on = [r for r in rs if r.block_size == rs[0].block_size and r.ids == rs[0].ids]
        overhead, per_token = _fit([(r.tokens, r.median_s or 0.0) for r in fit_on])
        big = max(fit_on, key=lambda r: r.tokens)
        point = Point(
            SHAPES[shape_name], big.tokens, big.block_size, "scattered" if big.ids == "scattered" else "contiguous"
        )
        recompute = big.tokens / prefill_tps
        note = (
            f"fit {overhead * 1e3:.2f} ms + {per_token * 1e6:.1f} us/token vs {1e6 / prefill_tps:.1f} us/token; "
            f"break-even {_even(break_even(overhead, per_token, prefill_tps))}"
        )
        out.append(_record(backend, point, big.median_s or 0.0, f"prefill@{prefill_tps:g}tok/s", recompute, note))
    return out


def _even(n: float) -> str:
    if math.isinf(n):
        return "never (recompute is faster)"
    return f"{math.ceil(n)} tokens" if n >= 1 else "any length (transfer is faster)"


def _record(backend: str, point: Point, transfer_s: float, baseline: str, recompute_s: float, note: str) -> Record:
    return Record(
        backend=backend, op="recompute", shape=point.shape.name, tokens=point.tokens, bytes=point.nbytes,
        blocks=point.blocks, median_s=transfer_s, p99_s=None, gbps=gbps(point.nbytes, transfer_s), baseline=baseline,
        baseline_s=recompute_s, baseline_gbps=gbps(point.nbytes, recompute_s), ratio=recompute_s / transfer_s,
        block_size=point.block_size, ids=point.ids, requests=1, reps=0, note=note, cold=evicting(),
    )  # fmt: skip


__all__ = ["TinyConfig", "TinyLlama", "break_even", "compare", "measure_prefill"]
