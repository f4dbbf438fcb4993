"""The layout planner (`python -m rlsp.plan`): model shapes, the memory and communication models against
the runtime's own numbers, recommended plans whose overrides compose and validate, refusals and
their explanations, and the exit code of a request nothing fits.

Shapes are public configs written as config.json files: Qwen2.5-0.5B / 7B / 14B, Llama-3.1-8B / 70B.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlsp.config.layout import RoleLayout, World
from rlsp.config.model_shape import shape_from_config
from rlsp.config.schema import RLSPConfig
from rlsp.config.store import register_schema
from rlsp.config.validate import validate_config
from rlsp.parallel.tp_checks import legal_tp_sizes
from rlsp.plan import HeadShare, MemoryOptions, Workload, cli, plan_memory, read_model_shape
from rlsp.plan.comm import plan_comm
from rlsp.plan.longest import LENGTH_GRANULE, plan_at
from rlsp.plan.memory import activation_terms, layer_saved_bytes, state_bytes

# Public model shapes (config.json fields), also used by scripts/gen_plan_doc.py for docs/plan.md.
SHAPES = {name.lower(): cfg for name, cfg in
          json.loads((Path(__file__).resolve().parents[1] / "data" / "public_model_shapes.json").read_text()).items()}
CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
PARAMS_B = {"qwen2.5-0.5b": 0.494, "qwen2.5-7b": 7.616, "qwen2.5-14b": 14.770, "llama-3.1-8b": 8.030,
            "llama-3.1-70b": 70.554}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    for name, cfg in SHAPES.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    return {name: str(root / name) for name in SHAPES}


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"^ *\d+  dp \d", line)]


def split(q: int, kv: int, u: int):
    return cli.head_split(q, kv, u)


@pytest.mark.parametrize("name", list(SHAPES))
def test_shape_counts_and_legal_tp_match_the_runtime(models, name):
    shape = read_model_shape(models[name])
    assert shape.params / 1e9 == pytest.approx(PARAMS_B[name], abs=0.002)
    assert shape.legal_tp() == legal_tp_sizes(SimpleNamespace(**SHAPES[name]))


def test_bad_model_dir_is_refused(tmp_path, capsys):
    code, _, err = run_cli(capsys, "--model", tmp_path, "--gpus-per-node", 8, "--gpu-memory-gib", 80, "--seq-len", 4096)
    assert code == 2 and "no config.json" in err
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    code, _, err = run_cli(capsys, "--model", tmp_path, "--gpus-per-node", 8, "--gpu-memory-gib", 80, "--seq-len", 4096)
    assert code == 2 and "num_hidden_layers" in err


def test_memory_shards_as_the_layout_says():
    shape = shape_from_config(SHAPES["qwen2.5-7b"])
    world = World(1, 8)
    full, fsdp8 = (state_bytes(shape, RoleLayout(world, fsdp_size=s), "actor", 2) for s in (1, -1))
    assert full[0] == pytest.approx(8 * fsdp8[0]) and full[0] == pytest.approx(12 * shape.params)
    opts = MemoryOptions(dtype_bytes=2)
    one = layer_saved_bytes(shape, Workload(RoleLayout(world), 8192, 8192, HeadShare(28, 4)), opts)
    uly = layer_saved_bytes(shape, Workload(RoleLayout(world, ulysses=4), 8192 // 4, 8192, HeadShare(7, 1)), opts)
    assert uly == pytest.approx(one / 4)  # an even Ulysses split divides every saved tensor by 4
    ckpt = plan_memory(shape, Workload(RoleLayout(world), 32768, 32768, HeadShare(28, 4)), MemoryOptions(2, True))
    plain = plan_memory(shape, Workload(RoleLayout(world), 32768, 32768, HeadShare(28, 4)), opts)
    assert ckpt.peak < plain.peak / 3 and sum(plain.terms.values()) == pytest.approx(plain.peak)


def test_lean_norms_keep_input_and_inverse_rms_only():
    """Per norm and token, HF's RMSNorm keeps h*(4+e)+4 bytes (fp32 upcast, normed value, 1/rms), the lean
    norm h*e+4 (its input, 1/rms): two norms per layer, 4*h bytes each fewer; the final norm likewise."""
    shape = shape_from_config(SHAPES["qwen2.5-7b"])
    w = Workload(RoleLayout(World(1, 8), ulysses=4), 8192, 8192, HeadShare(7, 1))
    hf, lean = (layer_saved_bytes(shape, w, MemoryOptions(2, True, lean_norm=on)) for on in (False, True))
    assert hf - lean == 2 * w.kept * 4 * shape.hidden
    hf, lean = (activation_terms(shape, w, "actor", MemoryOptions(2, True, lean_norm=on)) for on in (False, True))
    assert hf["recompute"] - lean["recompute"] == 2 * w.kept * 4 * shape.hidden
    assert hf["final_norm"] - lean["final_norm"] == w.kept * 4 * shape.hidden


@pytest.mark.parametrize("uly,ring,dtype_bytes,expected", [
    (2, 1, 4, 374_784), (4, 1, 4, 281_088), (1, 2, 4, 374_784), (1, 4, 4, 562_176),
    (2, 2, 4, 187_392 + 187_392), (2, 2, 2, 93_696 + 124_928),
])
def test_sequence_comm_equals_the_measured_bytes(uly, ring, dtype_bytes, expected):
    """Per rank and layer, forward + backward, from docs/benchmarks.md (benchmarks/sequence_comm.py):
    8 q / 4 kv heads of dim 16, a 488-token stream."""
    shape = shape_from_config({"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 8,
                               "num_key_value_heads": 4, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100})
    layout = RoleLayout(World(1, uly * ring), ulysses=uly, ring=ring)
    heads = split(8, 4, uly)
    w = Workload(layout, 488 // (uly * ring), 488, HeadShare(max(heads.q_counts), max(heads.kv_counts)))
    comm = plan_comm(shape, w, heads, dtype_bytes, checkpointing=False)
    assert comm.per_layer["ulysses"] + comm.per_layer["ring"] == expected


def _overrides(out: str) -> list[str]:
    last = out.rstrip("\n").splitlines()[-1]
    keys = last.split(" ")
    assert all("=" in k for k in keys), last
    return keys


def _compose_and_validate(keys: list[str], algo: str):
    cfg = OmegaConf.merge(OmegaConf.structured(RLSPConfig), OmegaConf.from_dotlist(keys))
    layout = validate_config(cfg)
    register_schema()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        hydra_layout = validate_config(compose(config_name=algo, overrides=keys))
    assert hydra_layout == layout
    return layout


# (model, nodes, GPUs per node, sequence length) of 80 GiB GPUs that have a plan (lengths beyond the model's
# max_position_embeddings are planned at that limit)
FEASIBLE = [("qwen2.5-0.5b", 1, 8, 32768), ("qwen2.5-0.5b", 8, 8, 1048576), ("qwen2.5-7b", 1, 8, 32768),
            ("qwen2.5-7b", 2, 8, 131072), ("qwen2.5-7b", 8, 8, 1048576), ("qwen2.5-14b", 2, 8, 32768),
            ("qwen2.5-14b", 1, 8, 131072), ("llama-3.1-8b", 1, 1, 131072), ("llama-3.1-70b", 8, 8, 32768),
            ("llama-3.1-70b", 8, 8, 131072)]


@pytest.mark.parametrize("name,nodes,per_node,seq", FEASIBLE)
def test_recommended_overrides_compose_and_validate(models, capsys, name, nodes, per_node, seq):
    code, out, _ = run_cli(capsys, "--model", models[name], "--nodes", nodes, "--gpus-per-node", per_node,
                           "--gpu-memory-gib", 80, "--seq-len", seq, "--overrides")
    assert code == 0 and "RECOMMENDED" in out
    keys = _overrides(out)
    layout = _compose_and_validate(keys, "grpo")
    values = dict(k.split("=", 1) for k in keys)
    assert layout.world_size == nodes * per_node
    planned = min(seq, SHAPES[name]["max_position_embeddings"])
    budget = int(values["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"])
    assert budget * layout.actor.token_shards >= planned  # one whole sequence fits a micro-batch
    assert int(values["data.max_prompt_length"]) + int(values["data.max_response_length"]) == planned
    memory = float(out.split("memory per GPU: ")[1].split(" GiB")[0])
    assert memory <= 80 * 0.9


def test_ppo_plan_carries_the_critic(models, capsys):
    code, out, _ = run_cli(capsys, "--model", models["qwen2.5-7b"], "--gpus-per-node", 8, "--gpu-memory-gib", 80,
                           "--seq-len", 16384, "--algo", "ppo", "--overrides")
    assert code == 0 and "critic (PPO, colocated)" in out
    keys = _overrides(out)
    layout = _compose_and_validate(keys, "ppo")
    assert layout.critic == layout.actor and "critic.use_dynamic_bsz=true" in keys


def test_refusals_are_explained(models, capsys):
    _, out, _ = run_cli(capsys, "--model", models["qwen2.5-14b"], "--nodes", 2, "--gpus-per-node", 8,
                        "--gpu-memory-gib", 80, "--seq-len", 32768)
    assert "40 q heads over 16 ranks: Ulysses 8 x ring 2; Ulysses 16 would span 2 nodes of 8 GPUs" in out
    _, out, _ = run_cli(capsys, "--model", models["qwen2.5-0.5b"], "--gpus-per-node", 8, "--gpu-memory-gib", 80,
                        "--seq-len", 131072, "--all")
    assert "tp 4: does not divide 14 q heads / 2 kv heads / MLP width 4864 evenly (legal tp for this model: 1, 2)" in out
    assert "14 q heads over 8 ranks: Ulysses 8; uneven (2 or 1 q heads per rank)" in out
    verdicts = table_rows(out)
    assert sum("RECOMMENDED" in v for v in verdicts) == 1
    assert all("RECOMMENDED" in v or "x the time per token" in v or "does not fit: " in v for v in verdicts)


def test_infeasible_request_exits_2_naming_why(models, capsys):
    code, out, err = run_cli(capsys, "--model", models["llama-3.1-70b"], "--gpus-per-node", 8, "--gpu-memory-gib", 8,
                             "--seq-len", 32768, "--overrides")
    assert code == 2
    assert "no layout fits 8 GiB GPUs (7.2 GiB usable)" in err and "activations and buffers" in err
    assert "does not fit: " in out and "actor_rollout_ref" not in out
    assert "longest length that fits on 8 GPUs: none" in err


def test_host_memory_bounds_parameter_offload(models, capsys):
    """Llama-3.1-70B on 8 GPUs of 24 GiB fits the devices only with its state offloaded: 70.55 B parameters x
    (16 bytes of trainable state + 4 of AdamW's temporaries + 2 of the reference) = 1,443 GiB per node."""
    args = ("--model", models["llama-3.1-70b"], "--gpus-per-node", 8, "--gpu-memory-gib", 24, "--seq-len", 32768)
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "need host memory for offloaded state and activations" in err
    host_gib = float(re.search(r"at least ([\d.]+) GiB per node", err).group(1))
    assert host_gib >= 70.554e9 * 22 / 2**30 and "> 921.6 GiB usable of --host-memory-gib=1024" in err
    code, out, _ = run_cli(capsys, *args, "--host-memory-gib", 2048, "--overrides")
    keys = _overrides(out)
    assert code == 0 and "actor_rollout_ref.actor.fsdp_config.param_offload=true" in keys
    assert "actor_rollout_ref.ref.fsdp_config.param_offload=true" in keys
    assert float(re.search(r"^host memory per node: ([\d.]+) GiB", out, re.M).group(1)) <= 2048 * 0.9
    _compose_and_validate(keys, "grpo")


def test_longest_length_is_the_boundary(models, capsys, tmp_path):
    """Nothing fits a million tokens of the Llama-3.1-8B shape (no position limit) on one 80 GiB GPU: the answer
    names the longest length that does, which fits while 1024 tokens more do not."""
    cfg = {k: v for k, v in SHAPES["llama-3.1-8b"].items() if k != "max_position_embeddings"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "--model", tmp_path, "--gpus-per-node", 1, "--gpu-memory-gib", 80,
                           "--seq-len", 1048576, "--no-reference")
    longest = int(re.search(r"longest length that fits on 1 GPUs: (\d+) tokens", err).group(1))
    assert code == 2 and 131072 < longest < 1048576
    req, _ = cli.build_request(cli.parse_args(["--model", str(tmp_path), "--gpus-per-node", "1", "--gpu-memory-gib",
                                                 "80", "--seq-len", "1048576", "--no-reference"]))
    assert plan_at(req, cli.head_split, longest) is not None
    assert plan_at(req, cli.head_split, longest + LENGTH_GRANULE) is None


def test_memory_options_follow_the_schema(models, capsys, monkeypatch):
    args = ("--model", models["qwen2.5-0.5b"], "--gpus-per-node", 8, "--gpu-memory-gib", 80, "--seq-len", 131072,
            "--overrides")
    monkeypatch.setattr(cli, "schema_has", lambda key: False)
    monkeypatch.setattr("rlsp.plan.overrides.schema_has", lambda key: False)
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and "not available in this version" in out
    keys = _overrides(out)
    assert not any("tiled_mlp" in k or "activation_offload" in k for k in keys)
    _compose_and_validate(keys, "grpo")


def test_budget_grows_for_short_sequences_and_plans_rank_by_throughput(models, capsys):
    code, out, _ = run_cli(capsys, "--model", models["qwen2.5-0.5b"], "--gpus-per-node", 8, "--gpu-memory-gib", 80,
                           "--seq-len", 4096, "--overrides", "--all")
    values = dict(k.split("=", 1) for k in _overrides(out))
    assert code == 0 and values["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "32768"
    rows = table_rows(out)
    fitting = [float(line.split("  ")[-2].split()[-1].replace(",", "")) for line in rows if "does not fit" not in line]
    assert "RECOMMENDED" in rows[0] and fitting == sorted(fitting, reverse=True)
