"""Time to first token of a 1,500-token prompt whose KV an engine loads from fs, against recomputing it.

In both vLLM process layouts — single-process (engine loop, scheduler and worker in one process, as
vLLM's offline ``LLM`` runs) and multiprocess (engine core and worker in their own processes) — the prompt's
KV must be loaded whole and give the same output. ``benches/vllm/ttft.py`` does the measuring; the figures are
printed here, never asserted (speed is the bench's to report).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from pdkit import assert_same_output
from ttft import measure, ttft

TOKENS = 1500
LAYOUTS = ("single", "multi")


def test_a_prompt_is_loaded_whole_in_every_layout(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "tiny-llama").symlink_to(tiny_model)  # measure() makes the model only where none is
    out = measure(tmp_path, tokens=TOKENS, prompts=3, layouts=LAYOUTS)
    figures = out["figures"]
    for layout in LAYOUTS:
        loaded, recomputed = out[layout]["loaded"], out[layout]["recomputed"]
        for name, got in loaded.items():
            assert got["num_cached_tokens"] == TOKENS // 32 * 32, (layout, name, got["num_cached_tokens"])
            assert_same_output(got, out["reference"][name])  # the producer recomputed these very prompts
        loaded_ms = statistics.median(1e3 * ttft(r) for r in loaded.values())
        recomputed_ms = statistics.median(1e3 * ttft(r) for r in recomputed.values())
        print(f"{layout}: loaded {loaded_ms:.1f} ms, recomputed {recomputed_ms:.1f} ms; {figures}")
