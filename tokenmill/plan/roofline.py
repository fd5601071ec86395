"""Predictions from a model's shape and a device profile. A decode step streams the weights once and each
request's KV, and multiplies every weight by each request's token: its time is the longer of the bytes over the
bandwidth and the flops over the peak (each times the device's measured efficiency), plus the KV read and the
step's own cost (fixed, and per row). A prompt is flops over the prefill peak. Capacity follows from Little's law:
B requests in flight, each taking TTFT + output_len x TPOT(B)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from tokenmill.plan.devices import DeviceProfile
from tokenmill.plan.model_shape import ModelShape, decode_weight_bytes, resident_weight_bytes


@dataclass(frozen=True)
class Workload:
    input_len: int = 128
    output_len: int = 256
    batch_size: int = 16             # the "TPOT at a batch size" figure
    context_len: int | None = None   # for max concurrency; default prompt + output
    request_rate: float | None = None   # requests/s the fleet must take
    tpot_slo_ms: float | None = None
    ttft_slo_ms: float | None = None
    price_per_hour: float | None = None
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "batch_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("request_rate", "tpot_slo_ms", "ttft_slo_ms", "price_per_hour"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be above 0, got {getattr(self, name)}")


@dataclass
class Plan:
    model: str
    device: str
    dtype: str
    quantization: str | None
    weights_bytes: int
    decode_weight_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    num_kv_blocks: int
    context_len: int
    max_concurrency: int
    predicted: dict
    capacity: dict

    def to_dict(self) -> dict:
        return asdict(self)


class Roofline:
    def __init__(self, shape: ModelShape, device: DeviceProfile, dtype: str, quantization: str | None,
                 group_size: int = 32, cache_dtype: str = "auto"):
        self.shape, self.device, self.dtype, self.quantization = shape, device, dtype, quantization
        self.weight_bytes = decode_weight_bytes(shape, dtype, quantization, group_size)
        self.kv_per_token = shape.kv_bytes_per_token(dtype, cache_dtype)
        fmt = quantization or "none"
        eff = device.efficiency
        peak = device.bf16_tflops * (2 if dtype == "float32" and device.kind == "cuda" else 1)
        if dtype == "float32" and device.kind == "cpu":
            peak /= 2      # fp32 matmuls reach about half the bf16 rate on these CPUs (../shared/perf-notes.md)
        self.bandwidth = device.bandwidth_gbs * 1e9 * eff.bandwidth
        self.decode_flops = peak * 1e12 * eff.decode_flops.get(fmt, eff.decode_flops["none"])
        self.prefill_flops = peak * 1e12 * eff.prefill_flops.get(fmt, eff.prefill_flops["none"])
        self.overhead = eff.step_ms(fmt) / 1000
        self.row_overhead = eff.per_row_ms(fmt) / 1000
        self.measured = device.linear_seconds_per_byte
        # the KV stream and attention's flops: the plain read bandwidth and bf16 rate (no kernel probe for them)
        self.kv_bandwidth = device.bandwidth_gbs * 1e9 * (eff.bandwidth if self.measured is None else 1.0)
        self.attention_flops = peak * 1e12 * (eff.decode_flops["none"] if self.measured is None else 0.5)
        self.head_bytes = self.weight_bytes - decode_weight_bytes(shape.without_lm_head(), dtype, quantization,
                                                                  group_size)

    def linear_time(self, rows: int, weight_bytes: int, flops_per_row: float, flops_rate: float) -> float:
        """Seconds for matmuls over `weight_bytes` of weights with `rows` rows: from the measured kernel times
        (interpolated between probed row counts, linear in rows past the largest), else the roofline."""
        if self.measured is None:
            return max(weight_bytes / self.bandwidth, rows * flops_per_row / flops_rate)
        probed = sorted(self.measured)
        if rows >= probed[-1]:
            return weight_bytes * self.measured[probed[-1]] * rows / probed[-1]
        hi = next(r for r in probed if r >= rows)
        lo = max((r for r in probed if r <= rows), default=hi)
        f = 0.0 if hi == lo else (rows - lo) / (hi - lo)
        return weight_bytes * ((1 - f) * self.measured[lo] + f * self.measured[hi])

    def _attention(self, batch: int, context: float) -> float:
        kv = batch * context * self.kv_per_token / self.kv_bandwidth
        flops = batch * (self.shape.flops_per_decoded_token(context) - self.shape.flops_per_decoded_token(0))
        return kv + flops / self.attention_flops

    def tpot(self, batch: int, context: float) -> float:
        """Seconds of one decode step of `batch` requests, each attending `context` tokens."""
        weights = self.linear_time(batch, self.weight_bytes, self.shape.flops_per_decoded_token(0),
                                   self.decode_flops)
        return self.overhead + (batch - 1) * self.row_overhead + weights + self._attention(batch, context)

    def ttft(self, prompt_len: int, batch: int = 1) -> float:
        """Seconds to compute `batch` prompts of `prompt_len` tokens together and sample their first tokens."""
        rows = batch * prompt_len
        body_flops = 2.0 * self.shape.linear_params(per_token=True)
        body = self.linear_time(rows, self.weight_bytes - self.head_bytes, body_flops, self.prefill_flops)
        head = self.linear_time(batch, self.head_bytes, 2.0 * self.shape.lm_head_params(), self.prefill_flops)
        attention = batch * (self.shape.prefill_flops(prompt_len) - body_flops * prompt_len
                             - 2.0 * self.shape.lm_head_params()) / self.prefill_flops
        return self.overhead + body + head + attention

    def predicted(self, w: Workload) -> dict:
        mean_context = w.input_len + w.output_len / 2
        return {"ttft_ms": 1000 * self.ttft(w.input_len),
                "tpot_ms_batch1": 1000 * self.tpot(1, mean_context),
                "batch_size": w.batch_size,
                "ttft_ms_batch": 1000 * self.ttft(w.input_len, w.batch_size),
                "tpot_ms_batch": 1000 * self.tpot(w.batch_size, mean_context),
                "output_tokens_per_s_batch": w.batch_size / self.tpot(w.batch_size, mean_context)}

    def capacity(self, w: Workload, max_concurrency: int) -> dict:
        """The batch that takes the most requests per second within the SLOs, what one replica then serves,
        the replicas a target rate needs, and the cost of a million output tokens."""
        mean_context = w.input_len + w.output_len / 2
        best = None
        for b in range(1, min(max_concurrency, w.max_num_seqs) + 1):
            tpot = self.tpot(b, mean_context)
            # a new request's prompt shares steps with the running decodes: its TTFT grows with them
            ttft = self.ttft(w.input_len) + tpot - self.overhead
            if (w.tpot_slo_ms and tpot * 1000 > w.tpot_slo_ms) or (w.ttft_slo_ms and ttft * 1000 > w.ttft_slo_ms):
                break
            rate = b / (ttft + w.output_len * tpot)
            if best is None or rate > best[1]:
                best = (b, rate, tpot, ttft)
        if best is None:
            return {"meets_slo": False, "reason": "even one request alone misses the SLO on this device"}
        b, rate, tpot, ttft = best
        out = {"meets_slo": True, "batch_size": b, "requests_per_s_per_replica": rate,
               "output_tokens_per_s_per_replica": rate * w.output_len, "tpot_ms": tpot * 1000,
               "ttft_ms": ttft * 1000}
        if w.request_rate:
            out["replicas"] = math.ceil(w.request_rate / rate - 1e-9)
        if w.price_per_hour:
            out["cost_per_1m_output_tokens"] = w.price_per_hour / 3600 / (rate * w.output_len) * 1e6
        return out


def kv_budget(device: DeviceProfile, weights: int, kv_cache_memory: int | None) -> int:
    """--kv-cache-memory when given; on a CPU the engine's own default (a quarter of the memory, 4 GiB at most); on
    a GPU what vLLM's gpu_memory_utilization 0.9 leaves after the weights and a 1 GiB activation reserve."""
    from tokenmill.config import DEFAULT_KV_CEILING, DEFAULT_KV_FRACTION

    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.kind == "cpu":
        return min(DEFAULT_KV_CEILING, int(device.memory_bytes * DEFAULT_KV_FRACTION))
    return max(0, int(device.memory_bytes * 0.9) - weights - (1 << 30))


def make_plan(name: str, shape: ModelShape, device: DeviceProfile, dtype: str, quantization: str | None,
              w: Workload, block_size: int = 16, kv_cache_memory: int | None = None, group_size: int = 32,
              cache_dtype: str = "auto") -> Plan:
    roof = Roofline(shape, device, dtype, quantization, group_size, cache_dtype)
    weights = resident_weight_bytes(shape, dtype, quantization, group_size)
    budget = kv_budget(device, weights, kv_cache_memory)
    num_blocks = budget // (roof.kv_per_token * block_size)
    context = w.context_len or w.input_len + w.output_len
    max_concurrency = num_blocks // math.ceil(context / block_size)
    return Plan(name, device.name, dtype, quantization, weights, roof.weight_bytes, roof.kv_per_token,
                num_blocks * block_size * roof.kv_per_token, num_blocks, context, max_concurrency,
                roof.predicted(w), roof.capacity(w, max_concurrency))
