"""DCP checkpoints of the engine: a checkpoint written by 2 ranks loads on 1 rank, on 2 ranks at
Ulysses 2, ring 2 or TP 2, and on 4 at Ulysses 2 x TP 2 (resharding) with every weight equal; one
written under TP 2 loads on one rank; and `export_hf` turns a checkpoint into a Hugging Face model
whose logprobs equal the trainer's (every response token, 1e-5)."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, P, _rollout_batch, policy_engine, tolerances
from tolerances import assert_tensor_close
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlsp.engine.checkpoint import load_engine, save_engine
from rlsp.engine.export import export_hf
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.workers.actor_loss import make_actor_loss

pytestmark = pytest.mark.distributed


def _train_and_save(rank: int, world: int, model_path: str, batch, ckpt: str, degrees: dict | None = None):
    engine = policy_engine(model_path, layout_dims(**(degrees or {})), lr=1e-2)
    engine.train_step(batch, P, 4, make_actor_loss(LOSS, float(batch["response_mask"].sum())),
                      temperature=1.0, with_entropy=True)
    save_engine(engine, os.path.join(ckpt, "actor"))
    if rank == 0:
        assets = os.path.join(ckpt, "actor", "huggingface")
        engine.config.save_pretrained(assets)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(assets)
    logprobs = engine.infer(batch, P, 3, "logprobs", temperature=1.0)
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    return (logprobs, params) if rank == 0 else None


def _load(rank: int, world: int, model_path: str, ckpt: str, degrees: dict):
    engine = policy_engine(model_path, layout_dims(**degrees), lr=1e-2)
    load_engine(engine, os.path.join(ckpt, "actor"))
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    return (params, engine.scheduler.state_dict()["last_epoch"]) if rank == 0 else None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    path = build_tiny_model(spec, str(tmp_path_factory.mktemp("tiny")))
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    logprobs, params = run_distributed(_train_and_save, 2, path, batch, ckpt)[0]
    return path, batch, ckpt, logprobs, params


@pytest.mark.parametrize("world,degrees", [
    (1, {}), (2, {"ulysses": 2}), (2, {"fsdp_size": 1}), (2, {"ring": 2}), (2, {"tp": 2}),
    (4, {"ulysses": 2, "tp": 2})])
def test_checkpoint_reshards_onto_another_layout(trained, world, degrees):
    path, _, ckpt, _, params = trained
    loaded, last_epoch = run_distributed(_load, world, path, ckpt, degrees)[0]
    assert loaded.keys() == params.keys()
    assert all(torch.equal(loaded[k], params[k]) for k in params)
    assert last_epoch == 1  # the LR schedule came back too


def test_tensor_parallel_checkpoint_loads_on_one_rank(trained, tmp_path):
    """Written by dp1 x tp2 (weights split by layer across tp, FSDP over nothing), read by one plain rank."""
    path, batch, _, _, _ = trained
    ckpt = str(tmp_path / "tp_ckpt")
    _, params = run_distributed(_train_and_save, 2, path, batch, ckpt, {"tp": 2})[0]
    loaded, last_epoch = run_distributed(_load, 1, path, ckpt, {})[0]
    assert loaded.keys() == params.keys() and last_epoch == 1
    assert all(torch.equal(loaded[k], params[k]) for k in params)


def test_export_gives_the_trainers_logprobs(trained, tmp_path):
    _, batch, ckpt, logprobs, params = trained
    out = export_hf(ckpt, str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    AutoTokenizer.from_pretrained(out)  # the tokenizer came along
    exported = dict(model.named_parameters())
    assert all(torch.equal(exported[k], params[k]) for k in exported)
    assert "lm_head.weight" not in set(os.listdir(out)) and model.config.tie_word_embeddings
    mask = batch["response_mask"]
    rtol, _, scale = tolerances(out)  # HF's forward of one row against the engine's packed one
    for b in range(len(batch)):
        keep = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][keep]
        n_resp = int(mask[b].sum())
        if n_resp == 0:
            continue
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
        hf = logp[:-1].gather(-1, ids[1:, None])[:, 0][-n_resp:]
        assert_tensor_close(hf, logprobs[b, :n_resp], rtol, scale)
    with pytest.raises(ValueError, match="holds no actor checkpoint"):
        export_hf(str(tmp_path), str(tmp_path / "nothing"))
