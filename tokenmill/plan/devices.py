"""Device profiles: memory, bandwidth and peak arithmetic, and the efficiency factors tokenmill reaches on each
(for GPUs, datasheet peaks times factors; `benchmarks/run.py plan` compares predictions with `tokenmill bench
latency`). `this` probes the machine it runs on instead: tokenmill's own matmul kernels at 1-256 rows, a 256 MB
read and a bf16 matmul, about ten seconds, since a CPU guest's speed drifts by the hour."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the profile's peaks that tokenmill's kernels reach, per weight format, and fixed costs."""
    bandwidth: float = 0.6          # of the read bandwidth, streaming weights and KV in a decode step
    decode_flops: dict = field(default_factory=lambda: {"none": 0.66, "int8": 0.48, "int4": 0.40})
    prefill_flops: dict = field(default_factory=lambda: {"none": 0.92, "int8": 0.90, "int4": 0.85})
    step_overhead_ms: float = 2.6   # scheduling, inputs, sampling, norms: what a step costs beyond the roofline
    format_step_ms: dict = field(default_factory=dict)   # a weight format's own fixed step cost, where it differs
    row_ms: dict = field(default_factory=dict)   # per decode row past the first, per format ("none": the default)

    def step_ms(self, fmt: str) -> float:
        return self.format_step_ms.get(fmt, self.step_overhead_ms)

    def per_row_ms(self, fmt: str) -> float:
        return self.row_ms.get(fmt, self.row_ms.get("none", 0.0))


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    kind: str                    # "cpu" or "cuda"
    memory_bytes: int
    bandwidth_gbs: float         # read bandwidth, GB/s
    bf16_tflops: float
    int8_tops: float
    efficiency: Efficiency = field(default_factory=Efficiency)
    linear_seconds_per_byte: dict | None = None   # measured: rows -> seconds per weight byte (probe_this_machine)
    note: str = ""

    def with_efficiency(self, **kw) -> DeviceProfile:
        return replace(self, efficiency=replace(self.efficiency, **kw))


_GiB = 1 << 30
# With the kernels' own times measured, what is left is the step's own cost: a fixed part (scheduling, inputs,
# sampling) and a part per decode row (norms, rotary, attention's bookkeeping, and for int8 each row's activation
# quantization inside the native layer stack, which the probe's separate calls do not see the same way). Fit to
# `benchmarks/run.py plan` on 2026-12-06 and 12-07 (EPYC): the residual TPOT at batch 1 and 16 less the probed
# matmuls, midway between the two days (which differed by up to 3 ms at batch 16 on the same code).
MEASURED = Efficiency(bandwidth=1.0, decode_flops={"none": 1.0}, prefill_flops={"none": 1.0}, step_overhead_ms=1.8,
                      format_step_ms={"int8": 1.2}, row_ms={"none": 0.1, "int8": 0.35})
# tokenmill's CUDA path is eager today: ~19 ms a token for the 135M model on an H200 (issue 57), nearly all of it
# per-layer launch overhead; the factor below stands for that until CUDA graphs land.
_EAGER_CUDA = Efficiency(bandwidth=0.7, decode_flops={"none": 0.5, "int8": 0.5, "int4": 0.5},
                         prefill_flops={"none": 0.5, "int8": 0.5, "int4": 0.5}, step_overhead_ms=19.0)

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in [
    DeviceProfile("epyc-zen5-2core", "cpu", 24 * _GiB, 50.0, 0.40, 0.80,
                  note="this project's 2-core AMD EPYC guest (AVX-512 BF16/VNNI), as probed on 2026-12-06"),
    DeviceProfile("h100", "cuda", 80 * _GiB, 3350.0, 989.0, 1979.0, _EAGER_CUDA, note="H100 SXM, datasheet peaks"),
    DeviceProfile("h200", "cuda", 141 * _GiB, 4800.0, 989.0, 1979.0, _EAGER_CUDA, note="H200 SXM, datasheet peaks"),
    DeviceProfile("a100", "cuda", 80 * _GiB, 2039.0, 312.0, 624.0, _EAGER_CUDA, note="A100 80GB SXM, datasheet peaks"),
    DeviceProfile("l4", "cuda", 24 * _GiB, 300.0, 121.0, 242.0, _EAGER_CUDA, note="L4, datasheet peaks"),
]}


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def probe_linear_seconds_per_byte(shape, quantization: str | None, group_size: int = 32,
                                  cap_bytes: int = 300 << 20, rounds: int = 3) -> dict:
    """tokenmill's own matmul kernels over this model's matrices, as a decode step runs them (q/k/v fused, o,
    gate/up fused, down, then the lm head; as many layers as fit `cap_bytes` of bf16, random values), at each
    count of PROBE_ROWS rows: seconds per byte of weight, per row count."""
    import torch

    from tokenmill.layers.quant.methods import get_quant_method

    torch.manual_seed(0)
    h, attn, mlp = shape.hidden_size, shape.num_heads * shape.head_dim, shape.intermediate_size
    layer = [(attn + 2 * shape.num_kv_heads * shape.head_dim, h), (h, attn), (2 * mlp, h), (h, mlp)]
    layer_bytes = 2 * sum(o * i for o, i in layer)
    shapes = layer * max(1, min(shape.num_layers, cap_bytes // layer_bytes))
    if 2 * shape.vocab_size * h <= cap_bytes:
        shapes.append((shape.vocab_size, h))
    method = get_quant_method(quantization, group_size)
    kernels = [(method.make_kernel("probe", torch.randn(o, i, dtype=torch.bfloat16) * 0.02, None, None), i)
               for o, i in shapes]
    nbytes = sum(getattr(k, "nbytes", 0) or 2 * i * o for (k, i), (o, _) in zip(kernels, shapes))
    # the probe calls each kernel from Python (~10-20 us apiece), a step's native stack does not: that cost, timed
    # on kernels too small to move any memory, is taken out of every pass
    tiny = method.make_kernel("probe", torch.randn(16, 64, dtype=torch.bfloat16), None, None)
    x_tiny = torch.randn(1, 64, dtype=torch.bfloat16)
    per_call = _median_time(lambda: [tiny(x_tiny) for _ in range(len(kernels))], 7) / len(kernels)
    inputs = {rows: {i: torch.randn(rows, i, dtype=torch.bfloat16) for _, i in kernels} for rows in PROBE_ROWS}

    def one_pass(rows: int) -> None:
        for k, i in kernels:
            k(inputs[rows][i])

    # a guest's neighbours slow it for seconds at a time: the sweep runs `rounds` times over and each row count
    # keeps its fastest round, so one slow stretch moves no figure
    best: dict[int, float] = {}
    for _ in range(rounds):
        for rows in PROBE_ROWS:
            seconds = _median_time(lambda rows=rows: one_pass(rows), 5 if rows <= 32 else 3)
            best[rows] = min(best.get(rows, seconds), seconds)
    return {rows: max(s / 2, s - per_call * len(kernels)) / nbytes for rows, s in best.items()}


def probe_this_machine(shape, quantization: str | None = None, group_size: int = 32) -> DeviceProfile:
    """This CPU as tokenmill's kernels see it: their time per weight byte at 1-256 rows (so the factors below
    are 1), the read bandwidth of a 256 MB sum (the KV stream), and the bf16 matmul rate (attention)."""
    import torch

    from tokenmill.platform import available_memory_bytes, one_cpu_per_core, process_cpus

    before = torch.get_num_threads()
    torch.set_num_threads(len(one_cpu_per_core(process_cpus())))
    try:
        a = torch.ones(1 << 26)
        read = a.numel() * a.element_size() / _median_time(a.sum, 7) / 1e9
        x = torch.randn(1024, 1024, dtype=torch.bfloat16)
        w = torch.randn(1024, 1024, dtype=torch.bfloat16)
        tflops = 2 * 1024 ** 3 / _median_time(lambda: torch.mm(x, w), 9) / 1e12
        rates = probe_linear_seconds_per_byte(shape, quantization, group_size)
    finally:
        torch.set_num_threads(before)
    stream = 1 / rates[1] / 1e9
    return DeviceProfile("this", "cpu", available_memory_bytes(), read, tflops, 2 * tflops, MEASURED, rates,
                         note=f"probed now: weights stream at {stream:.0f} GB/s, {read:.0f} GB/s read, "
                              f"{tflops * 1000:.0f} GFLOP/s bf16")


def get_profile(name: str, shape=None, quantization: str | None = None, group_size: int = 32) -> DeviceProfile:
    """A named profile, or `this` machine probed with `shape`'s matrices (a ModelShape)."""
    if name == "this":
        return probe_this_machine(shape, quantization, group_size)
    if name not in PROFILES:
        raise ValueError(f"--device {name!r} is not a known profile; choose this or one of {', '.join(PROFILES)}")
    return PROFILES[name]
