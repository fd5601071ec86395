"""Two plots from sweep.py's lines (tokenmill and vLLM together): TPOT against context, output tok/s against batch.

    python plot_sweep.py tm.jsonl vllm.jsonl OUT_DIR
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    *inputs, out = sys.argv[1:]
    rows = [json.loads(line) for f in inputs for line in Path(f).read_text().splitlines() if line.startswith("{")]
    engines = sorted({r["engine"] for r in rows})
    for sweep, x, y, xlabel, ylabel, name in [
            ("context", "context", "tpot_ms", "prompt tokens (one request)", "TPOT (ms)", "tpot_vs_context.png"),
            ("batch", "batch", "output_tok_s", "requests at once (256 in / 128 out)", "output tokens/s",
             "throughput_vs_batch.png")]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for e in engines:
            pts = sorted((r[x], r[y]) for r in rows if r["engine"] == e and r["sweep"] == sweep)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=e)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(out) / name, dpi=110)


if __name__ == "__main__":
    main()
