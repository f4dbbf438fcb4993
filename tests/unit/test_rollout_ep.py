"""The rollout engine's expert parallelism (`actor_rollout_ref.rollout.expert_parallel_size`, verl's key): legal are 1
and the engine's tensor-parallel degree, with vllm on a GPU and a mixture-of-experts model; vLLM then gets
`enable_expert_parallel=True` (its experts placed whole on the engine's ranks). Everything else is refused before
workers start, naming the key, the value and what is legal; on cpu it is refused because vLLM's CPU backend crashes
generating with it (a segmentation fault at the first step, vLLM 0.32).
"""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from rlsp.config.schema import RLSPConfig
from rlsp.rollout.engine_options import vllm_engine_options
from rlsp.rollout.support import rollout_ep_errors

KEY = "actor_rollout_ref.rollout.expert_parallel_size"
MOE = SimpleNamespace(model_type="qwen3_moe", num_experts=8)
DENSE = SimpleNamespace(model_type="qwen2")


def _rollout(ep: int, name: str = "vllm"):
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.actor_rollout_ref.rollout.expert_parallel_size = ep
    cfg.actor_rollout_ref.rollout.name = name
    return cfg.actor_rollout_ref.rollout


def test_vllm_gets_enable_expert_parallel_only_above_one():
    assert vllm_engine_options(_rollout(2), 64, on_gpu=True)["enable_expert_parallel"] is True
    assert "enable_expert_parallel" not in vllm_engine_options(_rollout(1), 64, on_gpu=True)


def test_legal_only_at_the_engines_tp_with_vllm_a_moe_model_on_gpu():
    assert rollout_ep_errors(MOE, _rollout(2), "cuda", tp=2) == []
    assert rollout_ep_errors(DENSE, _rollout(1), "cpu", tp=1) == []
    (wrong_degree,) = rollout_ep_errors(MOE, _rollout(4), "cuda", tp=2)
    assert f"{KEY}=4" in wrong_degree and "legal values: [1, 2]" in wrong_degree
    (hf,) = rollout_ep_errors(MOE, _rollout(2, "hf"), "cuda", tp=2)
    assert "name='hf'" in hf and "name=vllm" in hf
    (dense,) = rollout_ep_errors(DENSE, _rollout(2), "cuda", tp=2)
    assert "model_type='qwen2' has no experts" in dense
    (cpu,) = rollout_ep_errors(MOE, _rollout(2), "cpu", tp=2)
    assert "segmentation fault" in cpu and "on cpu legal: 1" in cpu
