"""One config source: a flat `EngineArgs` whose field metadata carries the help text, and the frozen
sub-configs the engine parts take.

`EngineArgs` generates the CLI flags and the `LLM(**kwargs)` keywords; `engine/create_config.py` turns it into an
`EngineConfig` (that needs the model's files, the platform and each feature's parser). This module is a leaf: it
imports nothing of tokenmill's but `utils`, so every layer can read its plain-number configs (a test checks it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tokenmill.utils import format_bytes, init_logger

logger = init_logger(__name__)

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# --kv-cache-dtype -> bytes per stored value (None: the model dtype's); attention/ops.py maps them to storage
KV_CACHE_DTYPES = {"auto": None, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
# --quantization and --quantization-group-size (layers/quant/methods.py implements them)
QUANTIZATION_METHODS = ("int8", "int4", "gguf", "w8a8")
# checkpoints quantized by other tools, named by their quantization_config's quant_method (model/prequantized.py)
PREQUANTIZED_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
GROUP_SIZES = (32, 64, 128)
# --cpu-isa: which CPU kernels run (cpu_isa.py says what each is)
CPU_ISAS = ("auto", "amx", "avx512", "avx2", "neon", "none")
# Fraction of free memory the KV cache may take when --kv-cache-memory is not given, and its ceiling.
DEFAULT_KV_FRACTION = 0.25
DEFAULT_KV_CEILING = 4 << 30


def check_quantization(name: str | None, group_size: int = 32, model_format: str = "hf") -> None:
    """`--quantization` and its group size, checked at start (layers/quant/methods.py implements them)."""
    if name in (None, "none") or name in PREQUANTIZED_METHODS:   # (the checkpoint's own: checked against it)
        return
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization {name!r} is not supported; choose one of "
                         f"{', '.join(QUANTIZATION_METHODS + PREQUANTIZED_METHODS)}")
    if name == "int4" and group_size not in GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}; "
                         f"got {group_size}")
    if name == "gguf" and model_format != "gguf":
        raise ValueError("--quantization gguf needs a .gguf model; for a safetensors model use int8 or int4")


# The server's prompt tokens per step while requests decode: a step of 512 prompt rows beside the decodes takes
# ~0.2 s on 2 cores, one of 2,048 ~0.8 s (W4 all at once: inter-token p99 0.24-0.29 s against 0.69-0.85 s,
# e4626e1:docs/benchmarks/2026-12-03-itl).
SERVER_PREFILL_TOKENS_WHILE_DECODING = 512


def _arg(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineArgs:
    """Every engine setting; the CLI and `LLM(...)` accept exactly these names."""

    model: str | None = _arg(None, f"Model: a Hugging Face folder, a .gguf file, or a hub id already on disk. "
                                   f"Default: the embedded {DEFAULT_MODEL_ID}.")
    tokenizer: str | None = _arg(None, "Tokenizer folder, if it differs from the model's.")
    dtype: str = _arg("auto", "Weight and activation dtype: auto follows the config where the device runs it well.",
                      choices=["auto", "float32", "bfloat16", "float16"])
    quantization: str | None = _arg(None, "Weight quantization: int8 (per output channel), int4 (groups of "
                                          "--quantization-group-size, a scale and a minimum each), gguf (a "
                                          ".gguf model's Q8_0/Q4_0/Q4_1 blocks run as they are), or w8a8 (int8 "
                                          "weights and, on steps of many rows, per-token int8 activations; "
                                          "SmoothQuant factors from `tokenmill quantize`). A checkpoint "
                                          "quantized by another tool (gptq, awq, compressed-tensors, fp8) is read "
                                          "as its config.json says, without the flag. Default: none (weights in "
                                          "--dtype; a .gguf file is dequantized).",
                                    choices=list(QUANTIZATION_METHODS + PREQUANTIZED_METHODS))
    quantization_group_size: int = _arg(32, "Inputs per int4 group (32, 64 or 128; it must divide every layer's "
                                            "input size).", choices=list(GROUP_SIZES))
    kv_cache_dtype: str = _arg("auto", "KV-cache dtype: auto (the model dtype), fp8 (= fp8_e4m3, as in vLLM), "
                                       "fp8_e5m2, or int8; one byte a value, so a cache of the same memory "
                                       "holds twice the blocks of a bf16 one. One scale per layer for K and "
                                       "one for V.", choices=list(KV_CACHE_DTYPES))
    calculate_kv_scales: bool = _arg(False, "Set each layer's K and V scales from the first step's values (the "
                                            "warm-up) instead of 1.0; always on for int8, which needs them.")
    seed: int = _arg(0, "Seed for sampling requests that have no seed of their own.")
    max_model_len: int | None = _arg(None, "Longest sequence (prompt + output). Default: the model's, capped by the "
                                           "KV cache.")
    block_size: int = _arg(16, "Tokens per KV-cache block.")
    kv_cache_memory: str | None = _arg(None, "KV-cache size in bytes or like '4GiB'. Default: a quarter of free "
                                             "memory, at most 4 GiB.")
    num_gpu_blocks_override: int | None = _arg(None, "Exact number of KV-cache blocks (overrides --kv-cache-memory).")
    kv_offload_bytes: str | None = _arg(None, "Host RAM for KV blocks evicted from the KV cache, in bytes or like "
                                              "'8GiB': kept by their prefix hash and copied back when a later prompt "
                                              "continues past the cache's hits (needs prefix caching). Off by default.")
    kv_offload_dir: str | None = _arg(None, "A folder for a second, disk tier under --kv-offload-bytes: blocks pushed "
                                            "out of its RAM are written here (at most --kv-offload-disk-bytes).")
    kv_offload_disk_bytes: str = _arg("16GiB", "Most bytes of blocks --kv-offload-dir keeps.")
    enable_prefix_caching: bool = _arg(True, "Reuse the KV cache of full blocks shared with earlier prompts.")
    enable_chunked_prefill: bool = _arg(True, "Split long prompts into chunks across steps.")
    max_num_batched_tokens: int = _arg(2048, "Token budget of one engine step.")
    long_prefill_token_threshold: int = _arg(0, "Most prompt tokens one request computes in a step (0: no cap), "
                                                "so running requests' next tokens never wait behind a long "
                                                "prompt's whole chunk.")
    prefill_tokens_while_decoding: int | None = _arg(
        None, f"Most prompt tokens of one step while other requests are decoding (0: no cap beyond "
              f"--max-num-batched-tokens), so their next tokens wait behind at most this much prompt work; a step "
              f"with no decodes takes the whole budget. Default: {SERVER_PREFILL_TOKENS_WHILE_DECODING} for the "
              f"server, whose clients watch tokens stream; no cap offline (LLM, complete, chat), where throughput "
              f"comes first (vLLM, too, picks its step budget by entry point).")
    max_num_seqs: int = _arg(256, "Most requests running at once.")
    scheduling_policy: str = _arg("fcfs", "Order of waiting requests: fcfs, or priority (lower first; a waiting "
                                  "request preempts running ones of lower priority when it does not fit).",
                                  choices=["fcfs", "priority"])
    max_queue_time: float | None = _arg(None, "Seconds a request may wait before it is first scheduled; past it, "
                                              "the engine aborts it and the client gets an error (overload).")
    attention_backend: str | None = _arg(None, "Attention backend (default: the platform's fastest).")
    served_model_name: str | None = _arg(None, "The model name the API reports and accepts.")
    cpu_bind: str = _arg("auto", "CPU threads of the engine: auto (one per physical core, each pinned to its "
                                 "own CPU), none (same count, not pinned), or a CPU list like '0-3'.")
    cpu_isa: str = _arg("auto", "CPU kernels: auto (the best this CPU runs), amx, avx512, avx2 (the portable "
                                "AVX2 + FMA kernels, also on a CPU that has more), neon (ARM), or none (torch's "
                                "operators, the reference path). A set the CPU lacks is an error.",
                        choices=list(CPU_ISAS))
    speculative_config: str | dict | None = _arg(
        None, "Speculative decoding, as vLLM's JSON: {\"method\": \"ngram\"|\"draft_model\"|\"eagle\"|\"eagle3\", "
              "\"num_speculative_tokens\": k, ...}; ngram takes prompt_lookup_min/max, draft_model a \"model\" "
              "folder (or none, with \"quantization\": \"int4\"|\"gguf\", for the target's own weights at 4 bits), "
              "eagle/eagle3 a head folder; \"disable_by_batch_size\": N stops proposing above N running requests "
              "(default 4). Greedy output is unchanged; sampled output keeps its distribution.")
    tensor_parallel_size: int = _arg(1, "Tensor-parallel ranks: every layer's matrices are split over N worker "
                                        "processes (gloo on CPU, nccl on CUDA), KV heads too.")
    pipeline_parallel_size: int = _arg(1, "Pipeline stages: the layers are split into N contiguous stages, each its "
                                          "own rank (or tensor-parallel group).")
    enable_expert_parallel: bool = _arg(False, "Mixture-of-experts models: spread the experts over the "
                                               "tensor-parallel ranks instead of splitting every expert.")
    distributed_executor_backend: str | None = _arg(
        None, "How ranks past the first are started when tensor or pipeline parallel is on: mp (processes on "
              "this machine, the default) or ray (actors on a running Ray cluster; `ray start --head` first).",
        choices=["mp", "ray"])
    kv_transfer_config: str | dict | None = _arg(
        None, "Disaggregated prefill and decode, as vLLM's JSON: {\"kv_connector\": \"ZmqConnector\", \"kv_role\": "
              "\"kv_producer\"|\"kv_consumer\"|\"kv_both\", \"kv_ip\": ..., \"kv_port\": ...}. A producer serves the "
              "KV blocks of prompts it computed on kv_ip:kv_port; a consumer pulls a request's prompt blocks from "
              "the address in its kv_transfer_params before scheduling it (`tokenmill router --prefill/--decode` "
              "does the handoff).")
    pooler: str | None = _arg(None, "Serve embeddings too (/v1/embeddings, LLM.embed): the final hidden states of "
                                    "a prompt pooled as last (its last token), mean or cls (its first token), "
                                    "L2-normalised. Off by default.", choices=["last", "mean", "cls"])
    limit_mm_per_prompt: str | dict | None = _arg(
        None, "Vision models: most media items one prompt may carry, as vLLM's JSON, e.g. '{\"image\": 4}' "
              "(default 8 images).")
    mm_processor_kwargs: str | dict | None = _arg(
        None, "Vision models: settings for the model's image processor, as vLLM's JSON, e.g. '{\"max_pixels\": "
              "401408}' to cap a Qwen2-VL image at 512 embeddings (its min_pixels and max_pixels).")
    max_image_pixels: int = _arg(4096 * 4096, "Vision models: the largest image accepted, in pixels (width x height); "
                                             "a larger one is refused with a 400.")
    max_media_bytes: str = _arg("25MiB", "Vision and speech models: the largest encoded image or audio file "
                                         "accepted (an upload, a data: URL or a fetched http(s) body).")
    max_audio_clip_s: float = _arg(3600.0, "Speech models: the longest audio accepted, in seconds (longer than 30 s "
                                           "is cut into windows, transcribed together and joined).")
    media_fetch_timeout: float = _arg(5.0, "Vision models: seconds an http(s) image_url may take to fetch.")
    allowed_local_media_path: str | None = _arg(None, "Vision models: a folder whose files file: image URLs may "
                                                      "read (vLLM's flag). Default: no file: URLs.")
    allowed_media_domains: str | list | None = _arg(
        None, "Vision models: the only hosts http(s) image URLs may name, comma-separated (vLLM's flag); listed "
              "hosts may be private. Default: any public host, no private or local addresses.")
    enable_lora: bool = _arg(False, "Serve LoRA adapters (PEFT folders): each request may name one, and requests of "
                                    "different adapters and of the base model share a batch.")
    max_loras: int = _arg(1, "Adapters that one engine step can run (their weights are stacked in slots).")
    max_lora_rank: int = _arg(16, "Largest adapter rank accepted; every slot is this wide.")
    max_cpu_loras: int | None = _arg(None, "Adapters kept loaded in memory, in slots or not (default: max_loras).")
    enforce_eager: bool = _arg(False, "Run every step through the Python layers: no native decoder stack on the "
                                      "CPU (which decode and prompt steps otherwise run as one native call), no "
                                      "CUDA graphs on a GPU.")
    cuda_graph_sizes: str | None = _arg(None, "Decode batch sizes captured as CUDA graphs on a GPU, like '1,2,4,8' "
                                              "(a step of n rows replays the smallest size >= n). Default: 1, 2, 4 "
                                              "and every 8 up to --max-num-seqs (at most 512).")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: rank = pipeline stage * tensor_parallel_size + tensor-parallel rank."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None   # "mp" | "ray"; None: mp when world_size > 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def backend(self) -> str:
        return "uni" if self.world_size == 1 and self.distributed_executor_backend is None else \
            (self.distributed_executor_backend or "mp")

    def validate(self, hf) -> None:
        """Clear errors at start, each naming the flag, for splits the model cannot take."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp < 1 or pp < 1:
            raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be at least 1, got {tp} and {pp}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, got "
                             f"{self.distributed_executor_backend!r}")
        heads, kv = hf.num_attention_heads, hf.num_key_value_heads
        if heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads")
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(f"tensor_parallel_size {tp} and the model's {kv} KV heads: one must divide the other")
        experts = num_experts_of(hf)
        if experts and self.enable_expert_parallel and experts % tp:
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size {tp} does not divide the model's "
                             f"{experts} experts")
        if self.enable_expert_parallel and not experts:
            raise ValueError("enable_expert_parallel: the model has no experts (it is not a mixture of experts)")
        sizes = [("intermediate_size", getattr(hf, "intermediate_size", 0))]
        if experts and not self.enable_expert_parallel:
            sizes.append(("moe_intermediate_size", getattr(hf, "moe_intermediate_size", 0)))
        for name, size in sizes:
            if size and size % tp:
                raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {name} {size}")
        if pp > hf.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size {pp} is larger than the model's {hf.num_hidden_layers} layers")
        if self.distributed_executor_backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError("distributed_executor_backend ray: Ray is not installed (pip install 'ray>=2.9')")

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """The contiguous layers of one pipeline stage; earlier stages take the remainder (the last one also
        runs the lm head)."""
        pp = self.pipeline_parallel_size
        base, extra = divmod(num_layers, pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads are split over the tensor-parallel ranks, or replicated when there are more ranks than heads."""
        return max(1, num_kv_heads // self.tensor_parallel_size)

    def kv_bytes_per_token(self, m: ModelConfig, cache_dtype: str = "auto") -> int:
        """One rank's KV bytes a token: its stage's layers (the first stage is the largest), its KV heads."""
        layers = len(self.stage_layers(m.num_layers, 0))
        return (m.kv_bytes_per_token(cache_dtype) // (m.num_layers * m.num_kv_heads)
                * layers * self.kv_heads_per_rank(m.num_kv_heads))

    def describe(self, num_layers: int) -> str:
        stages = ", ".join(f"stage {p}: layers {r.start}-{r.stop - 1}" for p in range(self.pipeline_parallel_size)
                           for r in [self.stage_layers(num_layers, p)])
        return (f"{self.world_size} ranks over {self.backend}: tensor parallel {self.tensor_parallel_size}"
                f"{' (experts spread over the ranks)' if self.enable_expert_parallel else ''}, pipeline parallel "
                f"{self.pipeline_parallel_size} ({stages})")


def num_experts_of(hf) -> int:
    """Routed experts of a mixture-of-experts config (Mixtral: num_local_experts; Qwen MoE: num_experts)."""
    return int(getattr(hf, "num_local_experts", 0) or getattr(hf, "num_experts", 0) or 0)


@dataclass(frozen=True)
class ModelConfig:
    model: str                 # the resolved path (folder or .gguf file)
    format: str                # "hf" or "gguf"
    hf_config: Any             # transformers PretrainedConfig (a GGUF file's: a PlainConfig holding its fields)
    tokenizer: str             # folder or .gguf file the tokenizer loads from
    dtype: str                 # "float32" | "bfloat16" | "float16"
    served_model_name: str
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    quantization: str | None = None
    quantization_group_size: int = 32
    enforce_eager: bool = False   # no native decoder stack: every layer through Python
    num_labels: int = 0           # a cross-encoder's (*ForSequenceClassification) score head width; 0: generative
    # a vision-language model's whole config (its vision_config, image token, projector); hf_config above is then
    # its text_config, which everything that runs the language model reads. None: a text model
    mm_hf_config: Any = None

    @property
    def is_multimodal(self) -> bool:
        return self.mm_hf_config is not None

    def kv_bytes_per_token(self, cache_dtype: str = "auto") -> int:
        itemsize = KV_CACHE_DTYPES.get(cache_dtype) or (4 if self.dtype == "float32" else 2)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"           # a key of KV_CACHE_DTYPES
    calculate_kv_scales: bool = False
    offload_blocks: int = 0             # blocks the host-RAM offload tier holds (0: no tier)
    offload_disk_blocks: int = 0        # blocks its disk tier holds (0: none)
    offload_dir: str | None = None

    def kv_bytes_per_token(self, m: ModelConfig) -> int:
        return m.kv_bytes_per_token(self.cache_dtype)

    @property
    def num_tokens(self) -> int:
        return self.block_size * self.num_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    num_lookahead_tokens: int = 0       # KV slots a draft model writes past the scheduled tokens
    max_queue_time: float | None = None  # seconds a request may wait before its first step
    max_loras: int = 1                  # distinct adapters running at once (their slots in the model)
    long_prefill_token_threshold: int = 0  # most prompt tokens of one request in a step; 0: no cap
    prefill_tokens_while_decoding: int = 0  # most prompt tokens of a step that carries decodes; 0: no cap


@dataclass(frozen=True)
class MediaOptions:
    """The front end's limits on media input (vLLM's flag names where it has them)."""
    max_image_pixels: int = 4096 * 4096
    max_media_bytes: int = 25 << 20
    max_audio_seconds: float = 3600.0
    fetch_timeout: float = 5.0                 # seconds for a whole http(s) fetch
    allowed_local_media_path: str | None = None   # file: URLs under this folder; None: no file: URLs
    allowed_media_domains: tuple[str, ...] = ()   # only these hosts when set (private ones too); else public only


@dataclass(frozen=True)
class MultiModalConfig:
    """What a vision model's engine holds for media: the encoder cache (embeddings kept by content hash, so an
    image sent again is not encoded again) and the embeddings the encoder may compute in one step."""
    limit_per_prompt: dict[str, int]
    processor_kwargs: dict   # --mm-processor-kwargs: what the image processor is loaded with
    encoder_cache_tokens: int
    encoder_budget_tokens: int
    max_tokens_per_item: int


@dataclass(frozen=True)
class CrossAttentionConfig:
    """An encoder-decoder model's second KV group (Whisper): a running request holds one slot of every decoder
    layer's cross-attention K/V over its encoder output, taken when its encoder runs and freed with it. The
    slots come out of the KV cache's memory budget; the encoder's positions are scheduled like prompt tokens."""
    num_slots: int
    source_positions: int          # encoder positions one slot holds (Whisper: 1,500 for 30 s)
    bytes_per_slot: int
    encoder_budget_tokens: int     # encoder positions computed in one step (never less than one item)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    seed: int = 0
    attention_backend: str | None = None
    cpu_bind: str = "auto"
    cpu_isa: str = "auto"               # the kernel set the engine selects (kernels.use_cpu_isa)
    cuda_graph_sizes: tuple[int, ...] = ()   # decode batch sizes a GPU replays from CUDA graphs (): eager
    speculative_config: Any = None      # spec_decode.config.SpeculativeConfig
    draft_model_config: ModelConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: Any = None      # kv_transfer.config.KVTransferConfig
    pooler: str | None = None           # embeddings: "last" | "mean" | "cls"; None: not served
    lora_config: Any = None             # lora.config.LoRAConfig when adapters are served
    mm_config: MultiModalConfig | None = None   # vision models: the encoder cache and its budget
    media: MediaOptions = field(default_factory=MediaOptions)   # vision models: what images the front end takes
    cross_config: CrossAttentionConfig | None = None   # encoder-decoder models: the cross-attention KV slots

    def log_summary(self) -> None:
        m, c, s, p = self.model_config, self.cache_config, self.scheduler_config, self.parallel_config
        kv_bytes = c.num_tokens * (c.kv_bytes_per_token(m) if p.world_size == 1 else
                                   p.kv_bytes_per_token(m, c.cache_dtype))
        logger.info("model %s (%s, %s), dtype %s, weights %s, max_model_len %d", m.served_model_name, m.format,
                    m.model, m.dtype, _weights_label(m), s.max_model_len)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens, %s in %s; maximum concurrency at %d tokens per "
                    "request: %.2fx", c.num_blocks, c.block_size, c.num_tokens, format_bytes(kv_bytes),
                    m.dtype if c.cache_dtype == "auto" else c.cache_dtype, s.max_model_len,
                    c.num_tokens / s.max_model_len)
        if p.world_size > 1:
            logger.info("parallel: %s; the KV cache above is each rank's (%d KV heads of %d, %d layers)",
                        p.describe(m.num_layers), p.kv_heads_per_rank(m.num_kv_heads), m.num_kv_heads,
                        len(p.stage_layers(m.num_layers, 0)))
        if self.speculative_config is not None:
            logger.info("speculative decoding: %s", self.speculative_config.describe())
        if c.offload_blocks:
            block_bytes = kv_bytes // max(c.num_blocks, 1)
            logger.info("KV offload tier: %d blocks (%s) in host RAM%s; evicted blocks are kept by prefix hash",
                        c.offload_blocks, format_bytes(c.offload_blocks * block_bytes),
                        f", {c.offload_disk_blocks} ({format_bytes(c.offload_disk_blocks * block_bytes)}) on disk in "
                        f"{c.offload_dir}" if c.offload_disk_blocks else "")
        if self.mm_config is not None:
            mm = self.mm_config
            logger.info("encoder cache: %d embeddings (%d images of %d), up to %d encoded a step; at most %s a "
                        "prompt", mm.encoder_cache_tokens, mm.encoder_cache_tokens // max(mm.max_tokens_per_item, 1),
                        mm.max_tokens_per_item, mm.encoder_budget_tokens,
                        ", ".join(f"{n} {k}s" for k, n in mm.limit_per_prompt.items()))
        if self.cross_config is not None:
            x = self.cross_config
            logger.info("cross-attention KV: %d slots of %d encoder positions = %s (one a running request), up to "
                        "%d encoder positions a step", x.num_slots, x.source_positions,
                        format_bytes(x.num_slots * x.bytes_per_slot), x.encoder_budget_tokens)
        if c.cache_dtype != "auto":
            logger.info("KV cache in %s: %d bytes a token instead of %d, so %.1fx the blocks of a %s cache of the "
                        "same memory", c.cache_dtype, c.kv_bytes_per_token(m), m.kv_bytes_per_token(),
                        m.kv_bytes_per_token() / c.kv_bytes_per_token(m), m.dtype)


def _weights_label(m: ModelConfig) -> str:
    if m.quantization == "int4":
        return f"int4 (groups of {m.quantization_group_size})"
    return m.quantization or "not quantized"
