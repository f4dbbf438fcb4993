"""Qwen3.5 / Qwen3.5-MoE checkpoints in their multimodal wrapper form (model_type qwen3_5 / qwen3_5_moe), trained
text-only on rows without images: rlsp loads their text causal LM through transformers' own class for the wrapper type.

- rlsp's one-rank packed forward of the loaded checkpoint equals transformers' Qwen3_5ForConditionalGeneration (or
  the MoE one) text forward of each row alone, every logprob (bound: tests/tolerances.py); the text weights are the
  wrapper's, bit for bit, and the vision tower's are not loaded.
- The checks take the text_config: every Ulysses degree accepted, ring / tp refused naming linear_attention, the resume
  check reads the text model's architecture; other wrapper configs (qwen3_vl) stay refused as multimodal wrappers.
- rows with images on such a checkpoint need its processor files (refused by name without them: data.image_key); a
  column of nulls is text data.
- The HF export path (a causal LM built from the saved text config, the trained weights, save_pretrained) writes a
  checkpoint transformers loads back as the same causal LM (same class, every weight equal): the text causal LM's
  config (model_type qwen3_5_text / qwen3_5_moe_text) and names (`model.layers.*`), without the vision tower (vLLM's
  Qwen3_5ForCausalLM reads these names too); the hf rollout engine loads the same class with the same names (its
  weight sync maps names by construction).
- rlsp.check accepts the wrapper at Ulysses 2 with rollout.name=hf and refuses vllm on cpu by name.
Tiny models: tests/tiny_qwen3_5.py.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from safetensors import safe_open
from tiny_linear import HEADS
from tiny_qwen3_5 import WRAPPERS, write_tiny_qwen3_5
from tolerances import logprob_tol
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from rlsp.check import main as check_main
from rlsp.checks.resume_check import _read_config, arch
from rlsp.data.packing import pack_sequences
from rlsp.models.family_checks import check_ring_support, check_sp_support, check_tp_windowed
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_backbone, load_causal_lm, read_model_config
from rlsp.parallel.ulysses import build_sp_context

LENS = (70, 13, 5)  # the first row spans two of the delta rule's 64-token chunks


@pytest.fixture(scope="module")
def wrapper_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen3_5")
    out = {family: write_tiny_qwen3_5(family, str(root / family)) for family in WRAPPERS}
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(4)]
    out["train"] = str(root / "train.parquet")
    pd.DataFrame(rows).to_parquet(out["train"])
    return out


def _packed_logprobs(model, ids, mask):
    packed = pack_sequences(ids, mask)
    with torch.no_grad():
        out = TokenLogprobModel(model)(packed.input_ids, packed.position_ids, packed.labels,
                                       build_sp_context(None, packed, *HEADS))["logprobs"]
    return out[packed.label_mask.bool()]


@pytest.mark.parametrize("family", WRAPPERS)
def test_packed_forward_equals_the_wrapper_text_forward(wrapper_dirs, family) -> None:
    path = wrapper_dirs[family]
    model = load_causal_lm(path)
    wrapper = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == type(wrapper).__name__.replace("ForConditionalGeneration", "ForCausalLM")
    assert model.config.model_type == WRAPPERS[family]
    full = wrapper.state_dict()
    mine = model.state_dict()
    assert not any(".visual." in k for k in mine)
    assert {k.replace("model.", "model.language_model.", 1) for k in mine if k != "lm_head.weight"} \
        == {k for k in full if k.startswith("model.language_model.")}
    for k, v in mine.items():
        assert torch.equal(v, full[k if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)]), k
    vocab, width = model.config.vocab_size, max(LENS)
    ids = torch.randint(1, vocab, (len(LENS), width), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(width)[None, :] < torch.tensor(LENS)[:, None]).long()
    rows = []
    with torch.no_grad():
        for b, n in enumerate(LENS):
            logp = wrapper(input_ids=ids[b:b + 1, :n]).logits[0].log_softmax(-1)
            rows.append(logp[:n - 1].gather(-1, ids[b, 1:n, None])[:, 0])
    expected = torch.cat(rows)
    got = _packed_logprobs(model, ids, mask)
    tol = logprob_tol(model.config, sum(LENS))
    err = float((got - expected).abs().max())
    assert got.shape == expected.shape and err <= tol, (err, tol)
    backbone = load_backbone(path)  # a critic's: the text decoder of the same weights
    assert type(backbone).__name__ == type(model.model).__name__
    assert all(torch.equal(v, mine[f"model.{k}"]) for k, v in backbone.state_dict().items())


@pytest.mark.parametrize("family", WRAPPERS)
def test_checks_take_the_text_config(wrapper_dirs, family) -> None:
    config = AutoConfig.from_pretrained(wrapper_dirs[family])
    assert config.model_type == family
    assert read_model_config("actor_rollout_ref.model.path", wrapper_dirs[family]).model_type == WRAPPERS[family]
    for sp in (1, 2, 3, 4):
        check_sp_support(config, sp)
    with pytest.raises(ValueError, match=f"ring_sequence_parallel_size=2: {WRAPPERS[family]} has linear_attention"):
        check_ring_support(config, 2)
    check_tp_windowed(config, 2)  # its text model takes tp (a run that loads the tower is refused: rlsp.checks)
    # resuming: the wrapper directory reads as the text model a checkpoint's actor/huggingface/config.json records
    assert arch(_read_config(wrapper_dirs[family])) == arch(config.text_config)
    # the planner's shape is the text model's: its parameter count equals the causal LM transformers loads
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from rlsp.config.model_shape import read_model_shape  # noqa: PLC0415

    text_model = AutoModelForCausalLM.from_pretrained(wrapper_dirs[family])
    assert read_model_shape(wrapper_dirs[family]).params == sum(p.numel() for p in text_model.parameters())


def test_other_wrappers_stay_refused() -> None:
    from transformers import Glm4vConfig

    config = Glm4vConfig(text_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                          num_key_value_heads=4, head_dim=16),
                         vision_config=dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=64))
    with pytest.raises(ValueError, match="glm4v: multimodal wrapper config"):
        check_sp_support(config, 1)


@pytest.mark.parametrize("family", WRAPPERS)
def test_export_and_hf_engine_keep_the_causal_lm_and_its_names(wrapper_dirs, family, tmp_path) -> None:
    from rlsp.rollout.hf_engine import HFEngine

    path = wrapper_dirs[family]
    trained = load_causal_lm(path)
    with torch.no_grad():  # a training step's change, so the export is checked on weights of its own
        for p in trained.parameters():
            p.add_(0.01)
    assets = tmp_path / "assets"
    trained.config.save_pretrained(assets)  # what the actor's checkpoint records (its engine's config)
    exported = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets), dtype=torch.float32)
    exported.load_state_dict(trained.state_dict())  # rlsp.engine.export._full_model: the same class and names
    exported.save_pretrained(tmp_path / "actor_hf")
    with safe_open(str(tmp_path / "actor_hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        original = {k.replace("model.language_model.", "model.") for k in f.keys() if ".visual." not in k}
    assert names == original  # the text causal LM's names (`model.layers.*`); the vision tower is dropped
    saved = AutoConfig.from_pretrained(tmp_path / "actor_hf")
    assert saved.model_type == WRAPPERS[family] and saved.architectures == [type(trained).__name__]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "actor_hf", dtype=torch.float32)
    assert type(back) is type(trained)
    mine = trained.state_dict()
    assert list(back.state_dict()) == list(mine)
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    engine = HFEngine(path)
    assert type(engine.model) is type(trained) and list(engine.model.state_dict()) == list(mine)
    engine.update_weights(trained.named_parameters())  # the weight sync: the trained names, unchanged
    assert all(torch.equal(v, mine[k]) for k, v in engine.model.state_dict().items())
    ids = torch.randint(1, trained.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():  # the synced engine scores a prompt as the exported checkpoint does
        logp = back(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    expected = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(engine.prompt_logprobs(ids)[1:])
    assert float((got - expected).abs().max()) <= logprob_tol(trained.config, len(ids))


def _check(tmp_path, dirs, family: str, *overrides: str, capsys) -> tuple[int, str]:
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={dirs['train']}",
                     "data.val_files=null", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2",
                     f"actor_rollout_ref.model.path={dirs[family]}", *overrides])
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("family", WRAPPERS)
def test_check_accepts_the_wrapper_at_ulysses_2(tmp_path, wrapper_dirs, family, capsys) -> None:
    rc, out = _check(tmp_path, wrapper_dirs, family, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                     "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "actor_rollout_ref.rollout.name=hf",
                     capsys=capsys)
    assert rc == 0, out
    rc, out = _check(tmp_path, wrapper_dirs, family, "actor_rollout_ref.rollout.name=vllm", capsys=capsys)
    assert rc == 2 and f"rollout.name=vllm cannot serve {WRAPPERS[family]} on cpu" in out, out


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_check_refuses_rows_with_images_without_a_processor_by_name(tmp_path, wrapper_dirs, family, capsys) -> None:
    frame = pd.read_parquet(wrapper_dirs["train"])
    frame["images"] = [[{"bytes": b"\x89PNG", "path": None}]] * len(frame)
    images = str(tmp_path / "images.parquet")
    frame.to_parquet(images)
    rc, out = _check(tmp_path, {**wrapper_dirs, "train": images}, family, "actor_rollout_ref.rollout.name=hf",
                     capsys=capsys)
    # with images the wrapper loads its vision tower (tests/unit/test_qwen3_5_vision_run.py), which reads them with the
    # model's processor: this directory has none
    assert rc == 2 and f"data.image_key='images': {images} has images in {len(frame)} rows" in out, out
    assert "has no preprocessor_config.json: no image processor to read images with" in out, out
    frame["images"] = [None] * len(frame)  # the column without images is text data
    frame.to_parquet(images)
    rc, out = _check(tmp_path, {**wrapper_dirs, "train": images}, family, "actor_rollout_ref.rollout.name=hf",
                     capsys=capsys)
    assert rc == 0, out
