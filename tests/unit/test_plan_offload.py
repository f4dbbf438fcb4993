"""The planner's parameter offload, actor-only runs, the logprob head's chunk, the critic flag and the position
limit: memory terms against hand-computed bytes, and the printed overrides against rlsp's validation and
`rlsp.check`.

Hand values for the Llama-3.1-8B shape (32 layers, hidden 4096, 32 q / 8 kv heads of dim 128, MLP 14336,
vocab 128,256, untied): a layer has 4096*128*48 + 4096*4096 + 3*4096*14336 + 2*4096 = 218,112,000
parameters, the root (embedding, lm_head, final norm) 2*128256*4096 + 4096 = 1,050,677,248, the model
8,030,261,248.
"""

from __future__ import annotations

import json
import re

import pytest
from test_plan import SHAPES, _compose_and_validate, _overrides, run_cli

from rlsp.check import run_checks
from rlsp.config.layout import RoleLayout, World
from rlsp.config.model_shape import shape_from_config
from rlsp.plan import HeadShare, MemoryOptions, Workload, plan_memory
from rlsp.plan.memory import activation_terms
from rlsp.plan.offload import host_bytes_per_node, offload_copy_bytes

LAYER, ROOT, PARAMS = 218_112_000, 1_050_677_248, 8_030_261_248
LLAMA8 = shape_from_config(SHAPES["llama-3.1-8b"])


@pytest.fixture()
def model_dir(tmp_path):
    def write(name: str, **changes) -> str:
        cfg = {**SHAPES[name], **changes}
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path / name)
    return write


def _work(world: int, tokens: int) -> Workload:
    return Workload(RoleLayout(World(1, world)), tokens, tokens, HeadShare(32, 8))


def test_shape_counts():
    assert (LLAMA8.layer_params, LLAMA8.root_params, LLAMA8.params) == (LAYER, ROOT, PARAMS)


def test_param_offload_moves_every_role_state_to_host():
    opts = MemoryOptions(dtype_bytes=2, checkpointing=True, param_offload=True)
    est = plan_memory(LLAMA8, _work(1, 8192), opts)
    assert est.terms["actor state"] == 0 and est.terms["ref state"] == 0
    assert "actor gradients" not in est.terms or est.terms["actor gradients"] == 0
    assert est.terms["offload staging"] == 3 * LAYER * 4  # two layers' fp32 shards in, one gradient shard out
    assert sum(est.terms.values()) == pytest.approx(est.peak, rel=1e-12)
    # host: actor 12 + 4 (gradient) + 4 (AdamW temporaries) bytes, reference 2 bytes per parameter; one rank
    assert host_bytes_per_node(LLAMA8, _work(1, 8192), opts, critic=False, ref=True) == 22 * PARAMS
    # eight ranks of a node, each with an eighth of the state: the same per node
    eighth = host_bytes_per_node(LLAMA8, _work(8, 8192), opts, critic=False, ref=True)
    assert eighth == pytest.approx(22 * PARAMS, rel=1e-12)
    # PCIe per micro-batch: fp32 layer shards in twice, gradients out once (12 B); the root in and out (8 B)
    assert offload_copy_bytes(LLAMA8, RoleLayout(World(1, 1)), "actor") == 32 * LAYER * 12 + ROOT * 8


def test_activation_offload_bytes_go_to_host():
    opts = MemoryOptions(dtype_bytes=2, checkpointing=True, activation_offload=True)
    assert host_bytes_per_node(LLAMA8, _work(1, 8192), opts, critic=False, ref=True) == 32 * 8192 * 4096 * 2


def test_no_reference_drops_exactly_its_state():
    opts = MemoryOptions(dtype_bytes=2, checkpointing=True)
    with_ref, without = (plan_memory(LLAMA8, _work(8, 16384), opts, ref=r) for r in (True, False))
    assert "ref state" not in without.terms
    assert with_ref.peak - without.peak == pytest.approx(PARAMS * 2 / 8, rel=1e-12)  # bf16 over an FSDP group of 8


def test_logprob_chunk_sets_the_head_term():
    """bf16: per vocab entry of a chunk an fp32 logit gradient (4) and, at the end, its bf16 copy (2)."""
    work = _work(1, 8192)
    head = {c: activation_terms(LLAMA8, work, "actor", MemoryOptions(2, logprob_chunk=c))["head"] for c in (1024, 4096)}
    assert head[4096] - head[1024] == 3072 * 128256 * 6
    assert head[1024] == 1024 * 128256 * 6 + 8192 * 4096 * 2  # plus the [tokens, hidden] input's gradient
    big = activation_terms(LLAMA8, work, "actor", MemoryOptions(2, logprob_chunk=1 << 20))["head"]
    assert big == 8192 * 128256 * 6 + 8192 * 4096 * 2  # a chunk never exceeds the rank's tokens


def test_actor_only_chunked_plan_validates_without_a_reference(model_dir, capsys):
    code, out, _ = run_cli(capsys, "--model", model_dir("llama-3.1-8b"), "--gpus-per-node", 1, "--gpu-memory-gib", 80,
                           "--seq-len", 131072, "--no-reference", "--logprob-chunk", 4096, "--overrides")
    keys = _overrides(out)
    assert code == 0 and "actor only (no reference" in out
    assert "actor_rollout_ref.actor.logprob_chunk_size=4096" in keys
    assert "actor_rollout_ref.actor.fsdp_config.param_offload=true" in keys  # 8 B x 16 bytes does not fit 72 GiB
    layout = _compose_and_validate(keys, "grpo")
    assert not layout.has_reference


def test_critic_flag_plans_ppo_with_the_critic_offloaded_too(model_dir, capsys):
    code, out, _ = run_cli(capsys, "--model", model_dir("llama-3.1-8b"), "--gpus-per-node", 2, "--gpu-memory-gib", 80,
                           "--seq-len", 65536, "--critic", "--overrides")
    keys = _overrides(out)
    assert code == 0 and "critic (PPO, colocated)" in out and "algorithm.adv_estimator=gae" in keys
    assert "critic.model.fsdp_config.param_offload=true" in keys
    layout = _compose_and_validate(keys, "ppo")
    assert layout.critic == layout.actor


def test_plan_and_check_agree_on_the_position_limit(model_dir, capsys):
    """Asked for 1M tokens of the Qwen2.5-0.5B shape (32,768 positions), the planner plans 32,768 and says why;
    rlsp.check accepts its overrides' lengths and refuses one token more."""
    path = model_dir("qwen2.5-0.5b")
    code, out, _ = run_cli(capsys, "--model", path, "--gpus-per-node", 8, "--gpu-memory-gib", 80, "--seq-len", 1048576,
                           "--overrides")
    assert code == 0 and "exceeds the model's max_position_embeddings=32768: planned at 32768 tokens" in out
    keys = _overrides(out)
    values = dict(k.split("=", 1) for k in keys)
    assert int(values["data.max_prompt_length"]) + int(values["data.max_response_length"]) == 32768
    position = re.compile("max_position_embeddings")
    assert not [p for p in run_checks(["--config-name", "grpo", *keys]).problems if position.search(p)]
    longer = [k if not k.startswith("data.max_response_length=") else
              f"data.max_response_length={int(values['data.max_response_length']) + 1}" for k in keys]
    problems = [p for p in run_checks(["--config-name", "grpo", *longer]).problems if position.search(p)]
    assert problems == ["data.max_prompt_length + data.max_response_length = 32769 exceeds the model's "
                        "max_position_embeddings=32768"]
