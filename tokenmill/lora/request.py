"""A request's adapter, as vLLM names it: `LoRARequest(lora_name, lora_int_id, lora_path)`."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """`lora_int_id` (>= 1) is the adapter's identity inside the engine: two requests with the same id run the
    same weights and may share prefix-cache blocks; a different adapter needs a different id."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def cache_key(self) -> bytes:
        """Mixed into the first block's hash: requests of different adapters never share KV blocks."""
        return f"\x00lora:{self.lora_int_id}:{self.lora_name}".encode()


def check_lora_request(lora: object) -> LoRARequest | None:
    if lora is None:
        return None
    if not isinstance(lora, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
    if not isinstance(lora.lora_int_id, int) or lora.lora_int_id < 1:
        raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {lora.lora_int_id!r}")
    if not lora.lora_name:
        raise ValueError("lora_request.lora_name must be a non-empty string")
    return lora
