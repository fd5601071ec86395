"""W1 (128 requests x 256 random tokens -> 128 forced tokens, all at once) with and without speculation
configured: off, on, off, on, each in a fresh process (two engines in one process slow the second one's large
batches), and the outputs must be identical.

  .venv/bin/python w1_spec.py '{"method":"ngram","num_speculative_tokens":3}'
"""
import json
import subprocess
import sys
import time


def one_run(spec: dict | None) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.datasets import random_requests

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in random_requests(128, 256, 128, 0, 1)]
    sp = SamplingParams(temperature=0.0, max_tokens=128, min_tokens=128, ignore_eos=True)
    llm = LLM(kv_cache_memory="4GiB", speculative_config=spec)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.engine_core.scheduler.kv_cache_manager.pool.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    print("RUN " + json.dumps(dict(wall_s=wall, preemptions=llm.engine_core.scheduler.num_preemptions,
                                   token_ids=[o.outputs[0].token_ids for o in outs])))


def main():
    if sys.argv[1] == "--one":
        one_run(json.loads(sys.argv[2]) if sys.argv[2] != "null" else None)
        return
    spec = sys.argv[1]
    walls, outputs, preempt = {"off": [], "on": []}, {}, {}
    for _ in range(2):
        for name, arg in (("off", "null"), ("on", spec)):
            out = subprocess.run([sys.executable, __file__, "--one", arg], capture_output=True, text=True, check=True)
            run = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RUN "))[4:])
            walls[name].append(round(run["wall_s"], 2))
            outputs[name], preempt[name] = run["token_ids"], run["preemptions"]
    print("RESULT " + json.dumps(dict(spec=json.loads(spec), wall_s_off=walls["off"], wall_s_on=walls["on"],
                                      preemptions=preempt, identical=outputs["off"] == outputs["on"])))


if __name__ == "__main__":
    main()
