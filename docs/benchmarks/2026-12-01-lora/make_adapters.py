"""Eight random PEFT LoRA adapters for the embedded SmolLM2 (rank 16 on q/k/v/o and gate/up/down, A and B drawn
from N(0, 0.02), seeds 1..8), written to OUT/lora-1 .. OUT/lora-8 for the W1 LoRA benchmark.

    python docs/benchmarks/2026-12-01-lora/make_adapters.py /tmp/smol-loras
"""

import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tokenmill.model.source import embedded_model_path

out = Path(sys.argv[1])
gguf = Path(embedded_model_path())
base = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
for i in range(1, 9):
    torch.manual_seed(i)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=modules, init_lora_weights=False))
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.02)
    model.save_pretrained(out / f"lora-{i}")
    base = model.unload()   # the base model without the adapter, for the next one
    print("wrote", out / f"lora-{i}")
