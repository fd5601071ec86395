"""W1 (128 requests x 256 random tokens -> 128 forced tokens, all at once) with and without speculation
configured, back to back in one process; the outputs must be identical.

  .venv/bin/python w1_spec.py '{"method":"ngram","num_speculative_tokens":3}'
"""
import json
import sys
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import random_requests


def main():
    spec = json.loads(sys.argv[1])
    reqs = random_requests(128, 256, 128, 0, 1)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    sp = SamplingParams(temperature=0.0, max_tokens=128, min_tokens=128, ignore_eos=True)
    results, outputs = {}, {}
    for round_ in range(2):
        for name, cfg in (("off", None), ("on", spec)):
            llm = LLM(kv_cache_memory="2GiB", speculative_config=cfg)
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            llm.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            results.setdefault(name, []).append(time.perf_counter() - t0)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
            del llm
    print("RESULT " + json.dumps(dict(spec=spec, wall_s_off=[round(x, 2) for x in results["off"]],
                                      wall_s_on=[round(x, 2) for x in results["on"]],
                                      identical=outputs["off"] == outputs["on"])))


if __name__ == "__main__":
    main()
