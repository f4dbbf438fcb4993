"""verl v0.9.0's FSDP example commands (tests/data/verl_commands_0_9.json) checked by `python -m rlsp.check`.

The 36 FSDP scripts of verl's release v0.9.0 with a vLLM rollout (gpt-oss's SGLang one is not run), expanded
by scripts/extract_verl_commands.py --0.9, run once each through rlsp.check (in-process) as written with
`--config-name verl` and only their paths swapped for local ones (data, run dir and cache as
tests/unit/test_verl_commands.py's `localize` swaps them): the policy and critic paths for a tiny model of the
family (model_type) the script names, each distillation teacher's for a tiny model of the teacher's family, the
reward model's for rlsp's tiny reward model, a custom reward file for a local one with the function it names.

Each family's tiny model is written once per module from transformers' own config class of that family:
config.json, generation_config.json and the char tokenizer of rlsp.models.tokenizer (rlsp.check reads the
config and the tokenizer, never the weights, so none are written; no processor files either). The text families
(qwen2, qwen3, qwen3_moe, mistral, seed_oss) get 8 query and 8 kv heads of dim 32, so every Ulysses and rollout
tensor-parallel degree of the commands (up to 8) fits. The others are 2 layers of hidden size 64 (8 heads of dim
32; the hybrid ones one linear-attention layer and one attention layer): qwen3_next (rlsp.models.linear_attention);
qwen3_5 and qwen3_5_moe (multimodal wrapper configs: their text model is trained, with the vision tower only when
the rows carry images, rlsp.data.vision_run); the vision-language families qwen2_5_vl, qwen3_vl and qwen3_vl_moe
(trained with their tower, rlsp.models.vision_lm); and glm4v, which rlsp does not train: its command must be
refused by a problem that names the model type. minicpmo has no class in transformers (its model ships remote
code): its directory holds only a config.json of that model_type.

Per command the test pins the exact set of refusals, each a (key, words of the reason) pair; every other key is
accepted; NOTES pins the note of each key accepted because it changes nothing computed. Keys and values of
features still in progress (rlsp.config.verl_compat NOT_YET_KEYS / NOT_YET_VALUES) count as accepted while
undeclared. EXPECTED_ACCEPTED lists the commands accepted today and ACCEPTED_PER_FAMILY counts them per family.
rlsp.check never raises on any of them: every problem is a line. The Qwen3.5 and Qwen3-Next commands are refused
only for `actor_rollout_ref.rollout.name=vllm` on this CPU machine (vLLM has no CPU kernel for their linear
attention) and, for two of them, settings of their own (REFUSED says which).

All commands are checked with the test's text data files. The Qwen3.5 image and video scripts' keys are accepted
with their notes: `data.image_patch_size=16` (compared with the model processor's patch size only on data with
images, rlsp.data.vision_processor.image_patch_size_errors; 16 is Qwen3.5's) and
`actor_rollout_ref.rollout.prompt_length` / `response_length` (equal to data.max_prompt_length /
max_response_length, verl's defaults; rlsp.config.validate_verl_runtime). On image data rlsp.check would also refuse
the vision-language commands' `actor_rollout_ref.rollout.name=vllm` (prompts with images roll out with the hf engine:
rlsp.data.vision_processor.image_run_errors; tests/unit/test_multimodal_check.py), and video rows without torchvision.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import Counter
from pathlib import Path

import pytest
from test_verl_commands import _problems, build_local, localize, spelled_as
from test_verl_commands_2026 import _matches, _pending

from rlsp.check import main as check_main
from rlsp.config.validate_keys import schema_keys

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
COMMANDS = [c for c in json.loads((DATA / "verl_commands_0_9.json").read_text())["commands"] if c["rollout"] == "vllm"]
# The families rlsp trains; qwen3_next since its Gated DeltaNet layers run in rlsp.models.linear_attention (its tiny
# model here stays the small hybrid one: one linear-attention layer, one attention layer); qwen3_5 and qwen3_5_moe
# (wrapper configs) since their text model is trained (rlsp.models.loading.TEXT_WRAPPERS; with the tower on rows with
# images). Their commands are refused here for vLLM on this CPU machine (REFUSED); the vision-language ones accepted.
SUPPORTED = ("qwen2", "qwen3", "qwen3_moe", "mistral", "seed_oss", "qwen3_next", "qwen3_5", "qwen3_5_moe",
             "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
MAX_POSITIONS = 32768  # the longest prompt + response of the commands: 22528 (Qwen3-Next)
TEACHERS = {"Qwen/Qwen3-32B": "qwen3", "Qwen/Qwen3-VL-32B-Instruct": "qwen3_vl",
            "Qwen/Qwen3.5-35B-A3B": "qwen3_5_moe"}  # the distillation teachers' families

EXPECTED_ACCEPTED = {
    "examples/cispo_trainer/run_qwen3_8b_fsdp.sh",
    "examples/gdpo_trainer/run_qwen3_8b_fsdp.sh",
    "examples/gmpo_trainer/run_qwen3_8b_fsdp.sh",
    "examples/gpg_trainer/run_qwen3_8b_fsdp.sh",
    "examples/gspo_trainer/run_qwen3_8b_fsdp.sh",
    "examples/grpo_trainer/run_mistral_nemo_12b_skyworkrm_fsdp.sh",
    "examples/grpo_trainer/run_qwen2_5_32b_fsdp.sh",
    "examples/grpo_trainer/run_qwen3_30b_a3b_fsdp.sh",
    "examples/grpo_trainer/run_qwen3_4b_fsdp.sh",
    "examples/grpo_trainer/run_qwen3_8b_fsdp.sh",
    "examples/grpo_trainer/run_seed_oss_36b_fsdp.sh",
    "examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh",
    "examples/otb_trainer/run_qwen3_8b_fsdp.sh",
    "examples/ppo_trainer/run_qwen3_8b_fsdp.sh",
    "examples/prefix_grouper/run_qwen3_8b_fsdp.sh",
    "examples/reinforce_plus_plus_trainer/run_qwen3_8b_fsdp.sh",
    "examples/remax_trainer/run_qwen2.5_math_7b_sync_fsdp.sh",
    "examples/remax_trainer/run_qwen3_8b_fsdp.sh",
    "examples/rloo_trainer/run_qwen3_8b_fsdp.sh",
    "examples/rollout_correction/run_qwen2_5_7b_fsdp.sh",
    "examples/rollout_correction/run_qwen2_5_7b_fsdp_multi_rs.sh",
    "examples/sapo_trainer/run_qwen3_30b_a3b_fsdp.sh",
    "examples/sapo_trainer/run_qwen3_8b_fsdp.sh",
    # vision-language (rlsp.models.vision_lm), checked with the test's text data: see the module docstring
    "examples/grpo_trainer/run_qwen2_5_vl_7b_fsdp.sh",
    "examples/grpo_trainer/run_qwen3_vl_30b_a3b_fsdp.sh",
    "examples/grpo_trainer/run_qwen3_vl_8b_fsdp.sh",
    "examples/on_policy_distillation_trainer/run_qwen3_8b_mopd_fsdp.sh",
    "examples/on_policy_distillation_trainer/run_qwen3_vl_8b_fsdp.sh",
}
# family -> (accepted, commands): the summary of EXPECTED_ACCEPTED.
ACCEPTED_PER_FAMILY = {"qwen3": (15, 15), "qwen3_moe": (2, 2), "qwen2": (4, 4), "mistral": (1, 1), "seed_oss": (1, 1),
                       "qwen3_5": (0, 4), "qwen3_5_moe": (0, 1), "qwen3_next": (0, 1), "glm4v": (0, 1),
                       "minicpmo": (0, 1), "qwen2_5_vl": (1, 1), "qwen3_vl": (3, 3), "qwen3_vl_moe": (1, 1)}


def _wrapper(family: str, cls: str) -> list[tuple[str, str]]:
    """A vision-language config: refused for the actor's and the reference's degrees."""
    return [(f"actor_rollout_ref.{role}.{key}", words) for role in ("actor", "ref") for key, words in (
        ("ulysses_sequence_parallel_size", f"{family}: multimodal wrapper config"),
        ("tensor_model_parallel_size", f"config {cls} needs integer num_attention_heads"))]


def _vllm_linear(text_family: str) -> tuple[str, str]:
    """A Qwen3.5 wrapper's text model (Gated DeltaNet layers) is trained, but not served by vLLM on this CPU machine."""
    return ("actor_rollout_ref.rollout.name=vllm", f"cannot serve {text_family} on cpu: its linear_attention")


# script -> (key, words of the reason) of every refusal it must get; a command not listed must be accepted.
REFUSED: dict[str, list[tuple[str, str]]] = {
    "examples/grpo_trainer/run_glm4_1v_9b_fsdp.sh": _wrapper("glm4v", "Glm4vConfig"),
    "examples/grpo_trainer/run_minicpm_o_2_6_fsdp.sh": [
        ("data.trust_remote_code", "remote code is not run"), ("actor_rollout_ref.model.trust_remote_code",
                                                               "remote code is not run"),
        ("data.custom_cls.path", "custom dataset classes are not loaded"),
        ("data.custom_cls.name", "custom dataset classes are not loaded"),
        ("actor_rollout_ref.rollout.free_cache_engine=false", "always frees the rollout engine's KV cache"),
        ("actor_rollout_ref.model.path", "model_type='minicpmo', which transformers 5.19.0 does not know")],
    "examples/grpo_trainer/run_qwen3_5_27b_fsdp.sh": [_vllm_linear("qwen3_5_text")],
    "examples/grpo_trainer/run_qwen3_5_2b_openr1_fsdp.sh": [_vllm_linear("qwen3_5_text")],
    "examples/grpo_trainer/run_qwen3_5_2b_video_fsdp.sh": [_vllm_linear("qwen3_5_text")],
    "examples/grpo_trainer/run_qwen3_5_35b_fsdp.sh": [_vllm_linear("qwen3_5_moe_text")],
    # The layout is refused (16 prompts over 32 workers); the model itself is trained (linear attention), but not
    # served by vLLM on this CPU machine.
    "examples/grpo_trainer/run_qwen3_next_80b_a3b_fsdp.sh": [
        ("actor_rollout_ref.rollout.name=vllm", "cannot serve qwen3_next on cpu"),
        ("actor_rollout_ref.actor.fsdp_config.model_dtype", "computes in actor_rollout_ref.model.dtype"),
        ("actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype", "per-dtype overrides are not supported"),
        ("data.train_batch_size=16", "must be divisible by the 32 workers"),
        ("actor_rollout_ref.ref.fsdp_config.optimizer_offload=true", "this role is frozen")],
    # The teacher pool's sizes, its tensor-parallel degrees and rollout.n=1 are accepted, and so are the student
    # (qwen3_5) and the teacher (qwen3_5_moe): their text models; left are vLLM on cpu and the expert-parallel degree.
    "examples/on_policy_distillation_trainer/run_qwen3_5_4b_fsdp.sh": [
        _vllm_linear("qwen3_5_text"),
        ("distillation.teacher_models.teacher_model.inference.expert_parallel_size", "takes rlsp's own settings")],
}

def _shape(tokens: dict, **extra) -> dict:
    """A supported family's tiny text model: 8 q / 8 kv heads of dim 32 (tensor parallel and Ulysses up to 8)."""
    return dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                head_dim=32, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, **tokens, **extra)


def _small(tokens: dict, **extra) -> dict:
    """An unsupported family's tiny text model: 2 layers, hidden size 64, 8 q / 8 kv heads of dim 32."""
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                head_dim=32, max_position_embeddings=MAX_POSITIONS, **tokens, **extra)


def _config(family: str, tokens: dict):
    """The tiny config of `family` from transformers' own config class (`tokens`: vocabulary and special ids)."""
    import transformers as tf

    # experts 256 wide: 32 per rank at rollout tp 8 (vLLM's CPU MoE kernel needs a multiple of 32 per rank)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)
    hybrid = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16)  # one Gated DeltaNet layer, one attention layer
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    builders = {
        "qwen2": lambda: tf.Qwen2Config(**_shape(tokens), use_sliding_window=False),
        "qwen3": lambda: tf.Qwen3Config(**_shape(tokens), use_sliding_window=False),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_shape(tokens, **moe), use_sliding_window=False),
        "mistral": lambda: tf.MistralConfig(**_shape(tokens), sliding_window=None),
        "seed_oss": lambda: tf.SeedOssConfig(**_shape(tokens)),
        "qwen3_next": lambda: tf.Qwen3NextConfig(**_small(tokens, **moe, **hybrid)),
        "qwen3_5": lambda: tf.Qwen3_5Config(text_config=_small(tokens, **hybrid), vision_config=vision),
        "qwen3_5_moe": lambda: tf.Qwen3_5MoeConfig(text_config=_small(tokens, **moe, **hybrid), vision_config=vision),
        "glm4v": lambda: tf.Glm4vConfig(text_config=_small(tokens), vision_config=vision),
        "qwen2_5_vl": lambda: tf.Qwen2_5_VLConfig(text_config=_small(tokens), **tokens,
                                                  vision_config={**vision, "fullatt_block_indexes": [0]}),
        "qwen3_vl": lambda: tf.Qwen3VLConfig(text_config=_small(tokens),
                                             vision_config={**vision, "deepstack_visual_indexes": [0]}),
        "qwen3_vl_moe": lambda: tf.Qwen3VLMoeConfig(text_config=_small(tokens, **moe),
                                                    vision_config={**vision, "deepstack_visual_indexes": [0]}),
    }
    return builders[family]()


def _build_family(family: str, out: Path) -> str:
    """A tiny model directory of `family`: its config, generation config and the char tokenizer."""
    from transformers import GenerationConfig

    from rlsp.models.tokenizer import build_char_tokenizer, stop_token_ids

    tokenizer = build_char_tokenizer()
    eos = stop_token_ids(tokenizer)
    out.mkdir(parents=True)
    if family == "minicpmo":  # remote code only: transformers has no config class of it
        (out / "config.json").write_text(json.dumps({"model_type": "minicpmo", "architectures": ["MiniCPMO"]}))
    else:
        tokens = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=eos[0],
                      bos_token_id=None)
        config = _config(family, tokens)
        assert config.model_type == family, (family, config.model_type)
        config.save_pretrained(out)
        GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _localized(command: dict, local: dict) -> list[str]:
    """The command through test_verl_commands.localize (data, run dir, cache), then its model paths swapped for
    the tiny model of each one's family and the tiny reward model, and a custom reward file for a local one."""
    models = local["models"]
    out = []
    for arg in localize(command["args"], local["base"]):
        key, eq, value = arg.partition("=")
        bare = key.lstrip("+")
        if bare in ("actor_rollout_ref.model.path", "critic.model.path"):
            value = models[command["family"]]
        elif bare in ("reward.reward_model.model_path", "reward_model.model.path"):
            value = local["base"]["reward_model"]
        elif bare.startswith("distillation.teacher_models.") and bare.endswith(".model_path"):
            value = models[TEACHERS[value]]
        elif bare in ("reward.custom_reward_function.path", "custom_reward_function.path"):
            value = local["reward_file"]
        out.append(f"{key}{eq}{value}")
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[int | BaseException, list[str], str]]:
    """script -> (rlsp.check's exit code, or what it raised; its problems; its report), every command checked once."""
    tmp = tmp_path_factory.mktemp("verl09")
    rows = max(int(dict(a.partition("=")[::2] for a in c["args"])["data.train_batch_size"]) for c in COMMANDS)
    reward_file = tmp / "reward.py"  # verl's scripts name reward files of verl's own tree
    reward_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return 0.0\n")
    families = {c["family"] for c in COMMANDS} | set(TEACHERS.values())
    local = {"base": build_local(tmp, rows), "reward_file": str(reward_file),
             "models": {f: _build_family(f, tmp / f"model_{f}") for f in sorted(families)}}
    out = {}
    for command in COMMANDS:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            try:
                rc: int | BaseException = check_main(_localized(command, local))
            except Exception as exc:  # noqa: BLE001 - the test fails naming it
                rc = exc
        out[command["script"]] = (rc, _problems(buffer.getvalue()), buffer.getvalue())
    return out


def test_the_commands_are_the_36_vllm_scripts():
    scripts = [c["script"] for c in COMMANDS]
    assert len(scripts) == len(set(scripts)) == 36
    assert Counter(c["family"] for c in COMMANDS) == {f: n for f, (_, n) in ACCEPTED_PER_FAMILY.items()}


def test_every_0_9_command_is_accepted_or_refused_by_name(outcomes):
    declared = set(schema_keys())
    accepted, refused, crashed = set(), {}, {}
    for command in COMMANDS:
        script = command["script"]
        rc, problems, _ = outcomes[script]
        if isinstance(rc, BaseException):
            crashed[script] = rc
            continue
        keys = [a.lstrip("+~").partition("=")[0] for a in command["args"]]
        assert rc in (0, 2) and (rc == 0) == (not problems), (script, rc, problems)
        named = set(keys) | set(spelled_as(keys)) | declared
        for problem in problems:  # every refusal names a key (of the command, or rlsp's spelling of one)
            assert any(k in problem for k in named), (script, problem)
        rest = [p for p in problems if not _pending(p, keys, declared)]
        if rest:
            refused[script] = rest
        else:
            accepted.add(script)
    assert not crashed, {script: repr(exc) for script, exc in crashed.items()}  # a problem is a line, never a raise
    for script, problems in refused.items():  # exactly the pinned refusals, one problem each
        expected = REFUSED.get(script, [])
        assert len(problems) == len(expected), (script, problems, expected)
        for want in expected:
            assert any(_matches(p, want) for p in problems), (script, want, problems)
    assert sorted(refused) == sorted(REFUSED), (sorted(refused), sorted(REFUSED))
    assert accepted == EXPECTED_ACCEPTED, (sorted(accepted - EXPECTED_ACCEPTED), sorted(EXPECTED_ACCEPTED - accepted))


def test_unsupported_families_are_refused_naming_the_model_type(outcomes):
    for command in COMMANDS:
        family, script = command["family"], command["script"]
        if family in SUPPORTED:
            continue
        rc, problems, _ = outcomes[script]
        assert rc == 2, (script, rc)
        names = any(f"{family}:" in p or f"model_type={family!r}" in p for p in problems)
        assert names, (script, family, problems)


def test_accepted_per_family(outcomes):
    per_family = {f: (0, 0) for f in ACCEPTED_PER_FAMILY}
    for command in COMMANDS:
        ok, n = per_family[command["family"]]
        per_family[command["family"]] = (ok + (outcomes[command["script"]][0] == 0), n + 1)
    summary = ", ".join(f"{f} {ok}/{n}" for f, (ok, n) in per_family.items())
    print(f"accepted: {sum(ok for ok, _ in per_family.values())}/{len(COMMANDS)} ({summary})")
    assert per_family == ACCEPTED_PER_FAMILY, summary
    assert sum(ok for ok, _ in per_family.values()) == len(EXPECTED_ACCEPTED)


_LENGTH_AND_PATCH_NOTES = [
    "actor_rollout_ref.rollout.prompt_length: verl's cap on the prompts its engine takes",
    "actor_rollout_ref.rollout.response_length: verl's generation limit",
    "data.image_patch_size: null or the model processor's patch_size"]
# script -> lines its report must hold: the note of every key accepted because it changes nothing computed.
NOTES = {
    "examples/grpo_trainer/run_qwen3_5_2b_openr1_fsdp.sh": _LENGTH_AND_PATCH_NOTES,
    "examples/grpo_trainer/run_qwen3_5_2b_video_fsdp.sh": _LENGTH_AND_PATCH_NOTES,
    "examples/rollout_correction/run_qwen2_5_7b_fsdp.sh": [
        "note: actor_rollout_ref.rollout.n=1 with algorithm.adv_estimator='rloo': every group is one sample, so its "
        "advantage is its raw score"],
    "examples/rollout_correction/run_qwen2_5_7b_fsdp_multi_rs.sh": [
        "note: actor_rollout_ref.rollout.n=1 with algorithm.adv_estimator='grpo': every group is one sample, so its "
        "advantage is its raw score (group mean 0, std 1"],
    "examples/gspo_trainer/run_qwen3_8b_fsdp.sh": [
        "actor_rollout_ref.actor.clip_ratio_c: the dual-clip bound of the losses that read it",
        "(gspo, geo_mean, sapo, cispo, gpg, clip_cov, kl_cov) ignore it, and so does rlsp"],
    "examples/prefix_grouper/run_qwen3_8b_fsdp.sh": [
        "actor_rollout_ref.actor.use_prefix_grouper=True: verl's prefix grouper computes a group's shared prompt once",
        "(n - 1) x prompt tokens more per group", "verl v0.9.0's FSDP engine never calls it"],
    "examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh": [
        "note: actor_rollout_ref.rollout.n=1 with algorithm.adv_estimator='grpo'",
        "actor_rollout_ref.rollout.max_model_len: verl's cap on the engine's context",
        "distillation.n_gpus_per_node: verl's teacher pool, any value >= 0: rlsp has no teacher pool",
        "distillation.nnodes: verl's teacher pool, any value >= 0: rlsp has no teacher pool",
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size: the tensor-parallel degree"],
}


@pytest.mark.parametrize("script", sorted(NOTES))
def test_keys_accepted_without_effect_are_noted(outcomes, script):
    rc, problems, report = outcomes[script]
    assert rc == (2 if script in REFUSED else 0), (script, problems)  # a refused command's report notes them too
    flat = " ".join(report.split())  # the report's lines wrap nothing, but be safe about spacing
    for want in NOTES[script]:
        assert want in flat, (script, want, report)
