"""The flags of media input -> MultiModalConfig (the engine's encoder cache) and MediaOptions (the front end's
limits), each checked with an error naming the flag."""

from __future__ import annotations

from tokenmill.config import CrossAttentionConfig, EngineArgs, MediaOptions, ModelConfig, MultiModalConfig
from tokenmill.multimodal.processing import DEFAULT_IMAGE_LIMIT, max_tokens_per_image
from tokenmill.utils import json_object, parse_bytes


def limits_of(value) -> dict[str, int]:
    """--limit-mm-per-prompt: vLLM's JSON {"image": N}; N = 0 turns image input off."""
    if value is None:
        return {"image": DEFAULT_IMAGE_LIMIT}
    value = json_object(value, "limit_mm_per_prompt")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()):
        raise ValueError("limit_mm_per_prompt must map a modality to a count >= 0, like {\"image\": 4}")
    unknown = sorted(set(value) - {"image"})
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: modality {', '.join(unknown)} is not served (only image)")
    return {"image": int(value.get("image", DEFAULT_IMAGE_LIMIT))}


def processor_kwargs_of(value) -> dict:
    """--mm-processor-kwargs: what the model's image processor is loaded with, like {"max_pixels": 401408}."""
    return {} if value is None else json_object(value, "mm_processor_kwargs")


def mm_config_for(args: EngineArgs, model_config: ModelConfig, max_num_batched_tokens: int) -> MultiModalConfig | None:
    """A vision model's encoder cache and budget: the step's token budget, and never less than one whole image
    (vLLM's rule), so an image that chunked prefill reaches can always be encoded."""
    if not model_config.is_multimodal:
        for name in ("limit_mm_per_prompt", "mm_processor_kwargs"):
            if getattr(args, name) is not None:
                raise ValueError(f"{name}: the model takes no images (it has no vision tower)")
        return None
    kwargs = processor_kwargs_of(args.mm_processor_kwargs)
    per_item = max_tokens_per_image(model_config.mm_hf_config, model_config.model, kwargs)
    budget = max(max_num_batched_tokens, per_item)
    return MultiModalConfig(limits_of(args.limit_mm_per_prompt), kwargs, encoder_cache_tokens=budget,
                            encoder_budget_tokens=budget, max_tokens_per_item=per_item)


def media_options(args: EngineArgs) -> MediaOptions:
    if args.max_image_pixels < 1:
        raise ValueError(f"max_image_pixels must be positive, got {args.max_image_pixels}")
    if args.max_audio_clip_s <= 0:
        raise ValueError(f"max_audio_clip_s must be positive, got {args.max_audio_clip_s}")
    if args.media_fetch_timeout <= 0:
        raise ValueError(f"media_fetch_timeout must be positive, got {args.media_fetch_timeout}")
    domains = args.allowed_media_domains
    if isinstance(domains, str):
        domains = [d for d in domains.replace(",", " ").split() if d]
    return MediaOptions(max_image_pixels=args.max_image_pixels,
                        max_media_bytes=parse_bytes(args.max_media_bytes, "max_media_bytes"),
                        fetch_timeout=float(args.media_fetch_timeout),
                        max_audio_seconds=float(args.max_audio_clip_s),
                        allowed_local_media_path=args.allowed_local_media_path,
                        allowed_media_domains=tuple(d.lower() for d in domains or ()))


def cross_config_for(args: EngineArgs, m: ModelConfig, kv_budget: int | None,
                     max_num_batched_tokens: int) -> CrossAttentionConfig | None:
    """An encoder-decoder model's cross-attention slots: as many as max_num_seqs, or fewer where the KV budget
    cannot also hold each slot's request at max_model_len in the paged cache (None: a decoder-only model)."""
    cfg = m.hf_config
    if not getattr(cfg, "is_encoder_decoder", False):
        return None
    positions = int(cfg.max_source_positions)
    itemsize = 4 if m.dtype == "float32" else 2
    slot = 2 * cfg.decoder_layers * positions * cfg.d_model * itemsize
    slots = args.max_num_seqs
    if kv_budget is not None:
        per_request = slot + m.max_model_len * m.kv_bytes_per_token(args.kv_cache_dtype)
        slots = min(slots, kv_budget // per_request)
    if slots < 1:
        raise ValueError(f"kv_cache_memory is too small for one request's cross-attention KV ({slot} bytes)")
    return CrossAttentionConfig(int(slots), positions, slot, max(max_num_batched_tokens, positions))
