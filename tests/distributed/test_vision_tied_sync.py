"""Tied-embedding vision-language models: the weight sync sends the output layer, and the hf engine samples from
the trained weights.

A tiny Qwen2.5-VL and Qwen3-VL with `tie_word_embeddings` (tests/tiny_vl.py) take one AdamW step at Ulysses 2 on rows
with images (tests/distributed/test_vision_exact.py's batch). The weights the sync sends (`iter_full_params`) carry
`lm_head.weight` after the text model's embedding (`model.language_model.embed_tokens.weight`), the same tensor;
the hf rollout engine takes every name, stays tied, and its model's logprobs of the rows (transformers' forward of
each row) equal the actor's after the step within tests/tolerances.py's two-forward bound (they differed by far more
before the sync). vLLM's name handling gets the output layer after a vision-language embedding as after a text one.
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS
from test_vision_exact import GRIDS, TOKENS, P, R
from tiny_vl import hf_row_logprobs, vl_rows, write_tiny_vl
from tolerances import decoder_chain, logprob_tol

from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.loading import load_causal_lm
from rlsp.models.vision_lm import VisionLogprobModel
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

EMBED = "model.language_model.embed_tokens.weight"


FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def _step_and_sync(rank: int, world: int, paths: list[str], batch):
    """Per model, one AdamW step at Ulysses `world`; rank 0 returns what the weight sync sends and the actor's
    logprobs after the step."""
    dims = layout_dims(ulysses=world, ring=1)
    loss_fn = make_actor_loss(LOSS, *global_counts(batch, dims.dp_group))
    out = []
    for path in paths:
        engine = FSDPEngine(VisionLogprobModel(load_causal_lm(path, dtype=torch.float32)), dims, torch.device("cpu"),
                            optim=OptimSettings(lr=1e-2, grad_clip=0.0))
        assert engine.tied  # the config says so at its top level only
        engine.optimizer.zero_grad(set_to_none=True)
        engine.backward_batch(batch, P, 3, loss_fn, None, temperature=1.0)
        engine.optimizer.step()
        sent = [(name, tensor.clone()) for name, tensor in engine.iter_full_params()]
        out.append((sent, engine.infer(batch, P, 3, "logprobs")))
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """{family: (model dir, rows, what the sync sent, the actor's logprobs [B, R] after the step)}."""
    from rlsp.models.tokenizer import build_char_tokenizer

    paths = [write_tiny_vl(f, str(tmp_path_factory.mktemp(f)), tie_word_embeddings=True) for f in FAMILIES]
    for path in paths:
        build_char_tokenizer().save_pretrained(path)  # the engine reads its pad id
    batch = vl_rows(GRIDS, P, R)
    results = run_distributed(_step_and_sync, 2, paths, batch)[0]
    return {f: (path, batch, *result) for f, path, result in zip(FAMILIES, paths, results)}


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_vision_language_sync_reaches_the_hf_engine(synced, family):
    from transformers import AutoConfig

    from rlsp.rollout.hf_engine import HFEngine

    path, batch, sent, actor_BR = synced[family]
    names = [name for name, _ in sent]
    assert names.index("lm_head.weight") == names.index(EMBED) + 1
    assert torch.equal(dict(sent)["lm_head.weight"], dict(sent)[EMBED])

    engine = HFEngine(path)
    mask_BR = batch["response_mask"].bool()

    def gap() -> float:
        with torch.no_grad():
            engine_BR = hf_row_logprobs(engine.model, batch)[:, P - 1:]
        return float((engine_BR - actor_BR)[mask_BR].abs().max())

    config = AutoConfig.from_pretrained(path)
    tol = logprob_tol(decoder_chain(config), TOKENS, value_scale=float(actor_BR[mask_BR].abs().max()))
    before = gap()
    engine.update_weights(sent)  # unknown names raise
    model = engine.model
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert gap() <= tol < before / 100, (gap(), tol, before)


def test_vllm_name_handling_adds_the_output_layer_after_a_vision_language_embedding():
    from rlsp.rollout.vllm_engine import _with_tied_head

    embed = torch.randn(4, 2)
    out = list(_with_tied_head([(EMBED, embed), ("model.visual.merger.mlp.0.weight", torch.zeros(1))]))
    assert [name for name, _ in out] == [EMBED, "model.visual.merger.mlp.0.weight", "lm_head.weight"]
    assert out[-1][1] is embed
    sent = [(EMBED, embed), ("lm_head.weight", embed)]  # the trainer already sent it: not twice
    assert [name for name, _ in _with_tied_head(sent)] == [EMBED, "lm_head.weight"]
