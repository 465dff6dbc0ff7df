"""rl/: post-training as workloads of the shared trainer: GRPO (`--task grpo`, after torchtitan's
experiments/rl and TRL's GRPOTrainer), DPO (`--task dpo`, after TRL's DPOTrainer) and their supervised
warm start (`--task sft`), on verifiable tasks: arithmetic, and safety (refuse what must be refused).

Read in this order (each file imports only those above it, and the core at the repository root):

    arithmetic.py   a verifiable task: `ab+cd=` prompts as a pure function of (seed, step), 500 held-out
                    problems, a reward that compares bytes; the registry of tasks (--reward-task)
    grpo.py         the algorithm: group advantages, the clipped surrogate against the engine's sampling
                    logprobs, aggregations grpo / dapo / dr_grpo, k3 KL to a reference
    engine.py       the one contract of an engine handle (start, push, generate, close): every message
                    bounded by the timeout; a dead or stalled engine is one line, exit 4; its failed write 5
    weight_sync.py  the trainer's weights to the engine: in buckets (one staging buffer, gathered shard
                    by shard), one gloo broadcast each, copied in place, versioned
    rollout.py      our engine in its own process: G samples per prompt on a static KV cache, logprobs
                    and the policy version
    safety.py       the safety task: harmful requests (refused), sums, look-alikes (answered), held out
                    by sentence frame; its evaluation's refusal check apart from its reward
    vllm_engine.py  --engine vllm: the same contract on vLLM, in the torch 2.13 environment's interpreter
    vllm_server.py  (runs there, imports nothing of ours): vLLM fed the buckets in place, pushes checked
    grpo_task.py    PolicyFamily (the LM family, also started from a train.py run), the policy workloads'
                    shared part (engine, held-out accuracy) and GRPOArithmetic (--task grpo)
    sft_task.py     SFTArithmetic (--task sft): the loss on the answers' bytes only
    dpo.py          the algorithm: sequence logprobs, the pair losses (sigmoid, hinge, ipo, robust)
    dpo_task.py     DPOPreferences (--task dpo): pairs from a JSONL file or the task, a frozen reference

    python train.py --task sft ... --out-dir runs/sft
    python train.py --task grpo --init-from runs/sft ... --out-dir runs/grpo
    python train.py --task dpo --init-from runs/sft ... --out-dir runs/dpo
    python -m rl.arithmetic write FILE        # solved problems as text (a corpus for --task lm)
    python -m rl.safety eval RUN --frames F   # a run's refusals on sentence frames of your own
"""
