"""`tokenmill quantize [MODEL]`: the W8A8 calibration pass. It runs the calibration text through the model
(eager, in fp32) and saves each norm-fed layer's per-channel activation maxima, which `--quantization w8a8`
turns into SmoothQuant factors at every start."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="Calibrate W8A8 once: activation maxima for SmoothQuant, saved beside the "
                                        "model (or in tokenmill's cache) for --quantization w8a8.")
    p.add_argument("model", nargs="?", default=None, help="A model folder or .gguf file (default: the embedded "
                                                          "SmolLM2).")
    p.add_argument("--calibration-file", default=None,
                   help="Plain text to calibrate on, cut into paragraphs (default: tokenmill's shipped text, "
                        "which the quality benchmark does not score).")
    p.add_argument("--max-tokens-per-text", type=int, default=512)
    p.set_defaults(func=run_quantize)


def run_quantize(ns: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from tokenmill import LLM
    from tokenmill.layers.quant.w8a8 import collect_activation_maxima, smoothing_path

    source = Path(ns.calibration_file) if ns.calibration_file else \
        Path(__file__).resolve().parents[1] / "engine" / "data" / "kv_calibration.txt"
    texts = [t.strip() for t in source.read_text().split("\n\n") if len(t.strip()) > 40]
    if not texts:
        raise ValueError(f"--calibration-file {source} holds no paragraphs of text")
    llm = LLM(ns.model, dtype="float32", enforce_eager=True)
    maxima = collect_activation_maxima(llm, texts, ns.max_tokens_per_text)
    if not maxima:
        raise ValueError("the model has no norm-fed linear layers to smooth (a Llama-family decoder is needed)")
    path = smoothing_path(llm.config.model_config.model)
    if path is None:
        raise ValueError("nowhere to save: the model's folder is not writable and TOKENMILL_CACHE_DIR is off")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in maxima.items()}, str(path))
    print(f"calibrated {len(maxima)} layers on {len(texts)} texts from {source.name}; saved {path}")
    return 0
