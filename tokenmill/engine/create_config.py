"""EngineArgs -> EngineConfig: reads the model's config, sizes the KV cache from the memory budget, and checks
each feature's settings against the others (the errors name the flag).

It lives apart from `tokenmill/config.py` because it needs the model loader, the platform and the feature
parsers, while the configs themselves stay leaves that any layer may import.
"""

from __future__ import annotations

import dataclasses
import os

from tokenmill.config import (
    DEFAULT_KV_CEILING,
    DEFAULT_KV_FRACTION,
    KV_CACHE_DTYPES,
    CacheConfig,
    CrossAttentionConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tokenmill.cpu_isa import resolve_cpu_isa
from tokenmill.kv_transfer.config import parse_kv_transfer_config
from tokenmill.lora.config import LoRAConfig
from tokenmill.model.model_config import load_model_config
from tokenmill.multimodal.engine_config import cross_config_for, media_options, mm_config_for
from tokenmill.platform import available_memory_bytes, parse_cpu_list
from tokenmill.spec_decode.config import check_against_max_model_len, parse_speculative_config
from tokenmill.spec_decode.draft_config import load_draft_model_config
from tokenmill.utils import init_logger, parse_bytes

logger = init_logger(__name__)


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Every sub-config from the flat arguments, each checked with an error that names its field."""
    model_config = load_model_config(args)
    parallel = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size, args.enable_expert_parallel,
                              args.distributed_executor_backend)
    parallel.validate(model_config.hf_config)
    spec = parse_speculative_config(args.speculative_config)
    kv_transfer = _checked_kv_transfer(args, parallel, spec)
    if spec is not None and parallel.world_size > 1:
        raise ValueError("speculative_config: speculative decoding does not run with tensor or pipeline "
                         "parallel yet; drop one of them")
    draft = None
    if spec is not None and spec.uses_model:
        draft = load_draft_model_config(spec, model_config, args)
    lora = _checked_lora(args, parallel)
    if getattr(model_config.hf_config, "is_encoder_decoder", False) and (spec is not None or lora is not None or
                                                                         parallel.world_size > 1):
        raise ValueError("an encoder-decoder model (Whisper) runs without speculative decoding, LoRA and tensor or "
                         "pipeline parallel for now")
    cache_config, cross = _size_caches(args, model_config, draft, parallel)
    max_model_len = _resolve_max_model_len(args, model_config, cache_config)
    if spec is not None:
        check_against_max_model_len(spec, max_model_len)
    prompt_cap = _checked_scheduler_limits(args)
    batched = args.max_num_batched_tokens
    if not args.enable_chunked_prefill:
        batched = max(batched, max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=batched, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill, policy=args.scheduling_policy,
        max_queue_time=args.max_queue_time, max_loras=lora.max_loras if lora else 1,
        num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
        long_prefill_token_threshold=args.long_prefill_token_threshold if args.enable_chunked_prefill else 0,
        prefill_tokens_while_decoding=prompt_cap if args.enable_chunked_prefill else 0)
    model_config = dataclasses.replace(model_config, max_model_len=max_model_len)
    if args.cpu_bind not in ("auto", "none"):
        parse_cpu_list(args.cpu_bind)
    resolve_cpu_isa(args.cpu_isa)   # a set this CPU cannot run fails here, naming cpu_isa
    mm = mm_config_for(args, model_config, batched)
    if mm is not None and (spec is not None or parallel.world_size > 1):
        raise ValueError("a vision model runs without speculative decoding and tensor or pipeline parallel for now")
    cfg = EngineConfig(model_config, cache_config, scheduler_config, seed=args.seed,
                       attention_backend=args.attention_backend, cpu_bind=args.cpu_bind, cpu_isa=args.cpu_isa,
                       speculative_config=spec, draft_model_config=draft, parallel_config=parallel,
                       kv_transfer_config=kv_transfer, pooler=_pooler(args.pooler, model_config), lora_config=lora,
                       mm_config=mm, media=media_options(args), cross_config=cross,
                       cuda_graph_sizes=() if args.enforce_eager else capture_sizes(args.cuda_graph_sizes,
                                                                                    args.max_num_seqs))
    cfg.log_summary()
    return cfg


def _checked_scheduler_limits(args: EngineArgs) -> int:
    """The step and queue limits, each a ValueError naming its field when out of range; returns the prompt
    tokens' cap while decoding (0: none)."""
    if args.max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {args.max_num_batched_tokens}")
    if args.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {args.max_num_seqs}")
    if args.long_prefill_token_threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be 0 (off) or positive, got "
                         f"{args.long_prefill_token_threshold}")
    prompt_cap = args.prefill_tokens_while_decoding or 0
    if prompt_cap < 0:
        raise ValueError(f"prefill_tokens_while_decoding must be 0 (no cap) or positive, got {prompt_cap}")
    if args.max_queue_time is not None and args.max_queue_time <= 0:
        raise ValueError(f"max_queue_time must be positive, got {args.max_queue_time}")
    return prompt_cap


# vLLM's default CUDA graph capture sizes: 1, 2, 4, then every 8 up to 512 (cut at --max-num-seqs)
DEFAULT_CUDA_GRAPH_SIZES = (1, 2, 4, *range(8, 513, 8))


def capture_sizes(spec: str | list[int] | tuple[int, ...] | None, max_num_seqs: int) -> tuple[int, ...]:
    """--cuda-graph-sizes ("1,2,4,8", a list, or None for the defaults) as sorted sizes, none above
    max_num_seqs (a larger one asked for becomes max_num_seqs: a full batch is then captured)."""
    if spec is None:
        top = min(max_num_seqs, DEFAULT_CUDA_GRAPH_SIZES[-1])
        return tuple(sorted({s for s in DEFAULT_CUDA_GRAPH_SIZES if s < top} | {top}))
    parts = spec.replace(" ", ",").split(",") if isinstance(spec, str) else list(spec)
    try:
        sizes = [int(p) for p in parts if str(p).strip()]
    except ValueError:
        raise ValueError(f"cuda_graph_sizes must be batch sizes like '1,2,4,8', got {spec!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {spec!r}")
    return tuple(sorted({min(s, max_num_seqs) for s in sizes}))


def _pooler(pooler: str | None, model_config) -> str | None:
    """A cross-encoder always pools its last token (its score head reads it there, as transformers does)."""
    if not model_config.num_labels:
        return pooler
    if pooler not in (None, "last"):
        raise ValueError(f"pooler must be last (or unset) for a cross-encoder, got {pooler!r}")
    return "last"


def _checked_lora(args: EngineArgs, parallel: ParallelConfig):
    if not args.enable_lora:
        return None
    if parallel.world_size > 1:
        raise ValueError("enable_lora: LoRA adapters do not run with tensor or pipeline parallel yet; drop one of "
                         "them")
    return LoRAConfig.create(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def _checked_kv_transfer(args: EngineArgs, parallel: ParallelConfig, spec):
    """--kv-transfer-config, refused where blocks could not be handed over whole (the error names the flag)."""
    kv_transfer = parse_kv_transfer_config(args.kv_transfer_config)
    if kv_transfer is None:
        return None
    if parallel.world_size > 1:
        raise ValueError("kv_transfer_config: KV transfer runs with one rank (tensor and pipeline parallel size 1)")
    if spec is not None:
        raise ValueError("kv_transfer_config: not combined with speculative decoding yet (a draft's own cache would "
                         "lack the transferred blocks)")
    if not args.enable_prefix_caching:
        raise ValueError("kv_transfer_config needs prefix caching: transferred blocks are found as a cached prefix")
    return kv_transfer


def _size_caches(args: EngineArgs, m: ModelConfig, draft: ModelConfig | None,
                 parallel: ParallelConfig) -> tuple[CacheConfig, CrossAttentionConfig | None]:
    """The paged KV cache and, for an encoder-decoder model, its cross-attention slots, which come out of the
    same budget first; the paged cache then holds no more than the slots' requests can fill."""
    budget = _kv_budget(args)
    cross = cross_config_for(args, m, budget, args.max_num_batched_tokens)
    if cross is not None and budget is not None:
        budget -= cross.num_slots * cross.bytes_per_slot
    cache_config = _size_cache(args, m, draft, parallel, budget)
    if cross is not None and args.num_gpu_blocks_override is None:
        most = cross.num_slots * -(-m.max_model_len // cache_config.block_size)
        cache_config = dataclasses.replace(cache_config, num_blocks=min(cache_config.num_blocks, most))
    return cache_config, cross


def _kv_budget(args: EngineArgs) -> int | None:
    """The KV cache's bytes (--kv-cache-memory, or a share of free memory); None when the blocks are given."""
    if args.num_gpu_blocks_override is not None:
        return None
    if args.kv_cache_memory is not None:
        return parse_bytes(args.kv_cache_memory, "kv_cache_memory")
    return min(DEFAULT_KV_CEILING, int(available_memory_bytes() * DEFAULT_KV_FRACTION))


def _size_cache(args: EngineArgs, m: ModelConfig, draft: ModelConfig | None = None,
                parallel: ParallelConfig | None = None, budget: int | None = None) -> CacheConfig:
    """Blocks that fit the KV budget; a draft model keeps its own cache of the same blocks, inside the budget.
    Under tensor or pipeline parallel the budget is each rank's, for its own layers and KV heads."""
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {args.block_size}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype!r} is not supported; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    bytes_per_token = m.kv_bytes_per_token(args.kv_cache_dtype) + (draft.kv_bytes_per_token() if draft else 0)
    if parallel is not None and parallel.world_size > 1:
        bytes_per_token = parallel.kv_bytes_per_token(m, args.kv_cache_dtype)
    bytes_per_block = bytes_per_token * args.block_size
    if args.num_gpu_blocks_override is not None:
        num_blocks = args.num_gpu_blocks_override
    else:
        num_blocks = (budget if budget is not None else _kv_budget(args)) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory is too small for one block of {bytes_per_block} bytes")
    return CacheConfig(block_size=args.block_size, num_blocks=int(num_blocks),
                       enable_prefix_caching=args.enable_prefix_caching, cache_dtype=args.kv_cache_dtype,
                       calculate_kv_scales=args.calculate_kv_scales or args.kv_cache_dtype == "int8",
                       **_offload_tier(args, bytes_per_block))


def _offload_tier(args: EngineArgs, bytes_per_block: int) -> dict:
    """The offload tier's capacities in blocks (--kv-offload-bytes, --kv-offload-dir)."""
    if args.kv_offload_bytes is None:
        if args.kv_offload_dir is not None:
            raise ValueError("kv_offload_dir is the disk tier under kv_offload_bytes: set kv_offload_bytes too")
        return {}
    if args.speculative_config:
        raise ValueError("kv_offload_bytes: not combined with speculative decoding yet (a draft's own cache would "
                         "lack the blocks copied back)")
    if not args.enable_prefix_caching:
        raise ValueError("kv_offload_bytes needs prefix caching: offloaded blocks are found by their prefix hash")
    ram = parse_bytes(args.kv_offload_bytes, "kv_offload_bytes") // bytes_per_block
    if ram < 1:
        raise ValueError(f"kv_offload_bytes is too small for one block of {bytes_per_block} bytes")
    disk = 0
    if args.kv_offload_dir is not None:
        os.makedirs(args.kv_offload_dir, exist_ok=True)
        disk = parse_bytes(args.kv_offload_disk_bytes, "kv_offload_disk_bytes") // bytes_per_block
    return dict(offload_blocks=int(ram), offload_disk_blocks=int(disk), offload_dir=args.kv_offload_dir)


def _resolve_max_model_len(args: EngineArgs, m: ModelConfig, c: CacheConfig) -> int:
    model_max = m.max_model_len
    if args.max_model_len is not None:
        if args.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {args.max_model_len}")
        if args.max_model_len > model_max:
            raise ValueError(f"max_model_len ({args.max_model_len}) is larger than the model's maximum ({model_max})")
        if args.max_model_len > c.num_tokens:
            raise ValueError(f"max_model_len ({args.max_model_len}) does not fit the KV cache ({c.num_tokens} tokens "
                             f"in {c.num_blocks} blocks); raise kv_cache_memory or lower max_model_len")
        return args.max_model_len
    if model_max > c.num_tokens:
        logger.warning("max_model_len capped from %d to %d tokens: the KV cache holds no more", model_max,
                       c.num_tokens)
    return min(model_max, c.num_tokens)
