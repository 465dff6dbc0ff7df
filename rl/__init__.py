"""rl/: GRPO post-training (`--task grpo`) and its supervised warm start (`--task sft`), as workloads
of the shared trainer, after torchtitan's experiments/rl and TRL's GRPOTrainer.

Read in this order (each file imports only those above it, and the core at the repository root):

    arithmetic.py   a verifiable task: `ab+cd=` prompts as a pure function of (seed, step), 500 held-out
                    problems, a reward that compares bytes
    grpo.py         the algorithm: group advantages, the clipped surrogate against the engine's sampling
                    logprobs, aggregations grpo / dapo / dr_grpo, k3 KL to a reference
    engine.py       the one contract of an engine handle (start, push, generate, close): every message
                    bounded by the timeout; a dead or stalled engine is one line, exit 4; its failed write 5
    weight_sync.py  the trainer's weights to the engine: in buckets (one staging buffer, gathered shard
                    by shard), one gloo broadcast each, copied in place, versioned
    rollout.py      our engine in its own process: G samples per prompt on a static KV cache, logprobs
                    and the policy version
    vllm_engine.py  --engine vllm: the same contract on vLLM, in the torch 2.13 environment's interpreter
    vllm_server.py  (runs there, imports nothing of ours): vLLM fed the buckets in place, pushes checked
    grpo_task.py    PolicyFamily (the LM family, also started from a train.py run), the policy workloads'
                    shared part (engine, held-out accuracy) and GRPOArithmetic (--task grpo)
    sft_task.py     SFTArithmetic (--task sft): the loss on the answers' bytes only

    python train.py --task sft ... --out-dir runs/sft
    python train.py --task grpo --init-from runs/sft ... --out-dir runs/grpo
    python -m rl.arithmetic write FILE        # solved problems as text (a corpus for --task lm)
"""
