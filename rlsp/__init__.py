"""rlsp: RL post-training for LLMs (GRPO, PPO, RLOO, REINFORCE++) with Ray, FSDP2, vLLM and Ulysses SP."""

__version__ = "0.1.0"
