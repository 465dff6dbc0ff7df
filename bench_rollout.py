"""bench_rollout.py: the rollout engines side by side, ours (rl/rollout.py) and vLLM
(rl/vllm_engine.py), for bench.py (`bench.py --rollout`, and part of the full run).

Both engines run in their own processes on the same weights, calls alternating between them (push,
rollout, push, rollout), so the ratio is measured inside one run on a noisy machine.
"""
import statistics
import time
from model import FLAVORS, ModelArgs, Transformer
from rl import arithmetic, rollout, vllm_engine


def rollout_table(repeats=5):
    """Both rollout engines on the same weights, alternating call by call: the push (the trainer's
    weights into the engine process) and a GRPO rollout batch (32 prompts x G = 8 samples), on the
    README's GRPO policy (4 new tokens) and on llama3_debug (32 new tokens). Medians of `repeats`."""
    prompts, rows = arithmetic.get_task("arith").prompts(0, 32), []
    policies = {"GRPO policy (dim 64, 2 layers)": (ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                                                                ffn_dim=192, max_seq_len=16), 4),  # (the README's)
                "llama3_debug (dim 192, 4 layers)": (FLAVORS["llama3_debug"], 32)}
    for label, (args, new_tokens) in policies.items():
        model = Transformer(args)
        engines = {"ours": rollout.EngineProcess(args, timeout_s=600)}
        t0 = time.perf_counter()
        try:
            engines["vllm"] = vllm_engine.VLLMEngineProcess(args, timeout_s=600)
            start_s = time.perf_counter() - t0
            times = {name: {"push": [], "rollout": []} for name in engines}
            for i in range(repeats + 1):  # (the first round: warm-up, not counted)
                for name, engine in engines.items():
                    sync = engine.sync(model.named_parameters(), i)
                    t = time.perf_counter()
                    ro = engine.generate(prompts, 8, new_tokens, temperature=1.0, seed=i, batch_size=256)
                    if i:
                        times[name]["push"].append(sync["seconds"])
                        times[name]["rollout"].append(time.perf_counter() - t)
                        times[name]["bytes"] = sync["bytes"]
                        times[name]["tokens"] = int(ro.mask_BxC.sum())
        finally:
            for engine in engines.values():
                engine.close()
        for name, t in times.items():
            roll = statistics.median(t["rollout"])
            rows.append({"policy": label, "engine": name, "push_ms": 1e3 * statistics.median(t["push"]),
                         "push_mib": t["bytes"] / 2**20, "rollout_s": roll, "samples_per_s": 256 / roll,
                         "tokens_per_s": t["tokens"] / roll, "new_tokens": new_tokens,
                         "start_s": start_s if name == "vllm" else None})
    return rows
