"""`tokenmill bench quality` and the W5 workload: the pieces, and one real run of the command on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenmill.bench.datasets import random_requests
from tokenmill.bench.quality import CORPUS_FILES, agreement, corpus_windows


def test_agreement_counts_identical_answers_and_their_common_start():
    ref = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    ours = [[1, 2, 3, 4], [5, 6, 0], [0, 9]]
    identical, start = agreement(ours, ref)
    assert identical == 1 / 3 and start == (4 + 2 + 0) / 3


def test_corpus_ships_tens_of_thousands_of_tokens(smol_tokenizer):
    assert all(f.is_file() for f in CORPUS_FILES) and (CORPUS_FILES[0].parent / "README.md").is_file()
    windows = corpus_windows(smol_tokenizer, 1024)
    assert sum(map(len, windows)) > 30000 and all(len(w) <= 1024 for w in windows)
    first = corpus_windows(smol_tokenizer, 1024, max_tokens=1500)
    assert [len(w) for w in first] == [1024, 476] and first[0] == windows[0]


def test_w5_prompt_lengths_span_their_range():
    reqs = random_requests(64, 1024, 8, seed=5, min_input_len=64)
    lengths = [len(r.prompt_token_ids) for r in reqs]
    assert min(lengths) >= 64 and max(lengths) <= 1024 and len(set(lengths)) > 50


@pytest.mark.slow
def test_quality_command_prints_the_table(tiny_model_dir, tmp_path):
    out_json = tmp_path / "q.json"
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "bench", "quality", "--model", str(tiny_model_dir("qwen2")),
           "--dtype", "float32", "--modes", "bf16,int8,int4-g128,kv-fp8", "--max-tokens", "4", "--window", "256",
           "--max-corpus-tokens", "2048", "--kv-cache-memory", "16MiB", "--output-json", str(out_json)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| mode | linear weights (MiB) |" in run.stdout
    results = {r["mode"]: r for r in json.loads(out_json.read_text())["results"]}
    assert results["bf16"]["greedy_identical"] == 1.0 and results["bf16"]["perplexity"] > 1
    assert results["int8"]["linear_weight_mib"] > 0 and results["int8"]["perplexity"] > 1
    assert "does not divide the input size 64" in results["int4-g128"]["error"]  # the tiny models' hidden size
    assert results["kv-fp8"]["kv_bytes_per_token"] * 4 == results["bf16"]["kv_bytes_per_token"]  # fp32 -> 1 byte
