"""rlsp's packed training forward on the newer model families, on CUDA in bf16: exactness, step time, memory.

    python benchmarks/gpu_families.py --device cuda                       # every family, 32768 tokens
    python benchmarks/gpu_families.py --device cpu --tokens 512 --seq-len 128 --families gemma2,qwen3_next

Families (transformers' own config classes, random init; benchmarks/family_configs.py): gemma2 (attention and final-logit soft-capping,
sliding + full layers), gemma3 (sliding + global layers), gpt_oss (attention sinks, sliding window, MoE),
deepseek_v3 (multi-latent attention, MoE), qwen3_next (Gated DeltaNet + gated full attention, MoE) and
qwen2_5_vl (its text path: text-only rows through the vision-language head model). On CUDA each has a "mid"
shape: the family's real head dims and widths, 4 layers, a 32k vocabulary and few experts; the windows are
shortened (1024 / 512 / 128 tokens) so they bite on rows of --seq-len 4096. On CPU a small shape (fp32).

Per family, ONE JSON line:
  1. exactness: per-token logprobs of rlsp's packed forward (rows of --seq-len, 3/4, 1/2 and 1/4 of it packed in
     one stream, rlsp.models.lm / rlsp.models.vision_lm over rlsp_ulysses) against transformers' own forward of
     each row alone (same weights and dtype; eager attention where the family needs it): `max_abs_diff` against
     `bound`, the formula in `bound_formula` (tests/tolerances.py's derivation 1 over the 4L+1 chained stages of
     the forward: bf16 GEMMs and softmaxes accumulate in fp32, so each stage carries the rounding of its output to
     the dtype, u = 2^-8, plus fp32 accumulation over its longest reduction n, both computations, at the scale
     of the largest reference logprob);
  2. forward+backward of rlsp's path at --tokens (rows of --seq-len; one warm-up step first): `fwd_bwd_s`,
     `peak_mem_gib` (torch.cuda.max_memory_allocated, weights included) and `peak_extra_gib` over the weights;
     {"oom": true} when it does not fit.
gemma3 also reports `window_mem`: attention-only forward+backward peak memory of one sliding-window layer (rlsp's
kernel) on one row of --tokens/2 and --tokens tokens; `window_linear` is true when the ratio is <= 2.5 (2 for
O(tokens x window), 4 for O(tokens^2)). `kernel`: the kernels rlsp's path ran (sdpa, flash_attn, torch: the
explicit softmax of soft-capped / sink layers, fla: flash-linear-attention's Gated DeltaNet). `median_abs_diff` /
`p99_abs_diff` beside the maximum tell a MoE routing flip (a few tokens off by O(1)) from a kernel error (all tokens).
A stage that raises adds "stage: error" to `failures` and the other stages still run; a family whose model cannot
be built prints {"family": ..., "ok": false, "failures": [...]}; the exit status is 1 when any family failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: E402

import rlsp.models.attention as attention  # noqa: E402
import rlsp.models.linear_attention as linear_attention  # noqa: E402
from benchmarks.family_configs import FAMILIES, family_config  # noqa: E402
from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.models.family_checks import num_heads, text_model_config
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.models.vision_lm import build_logprob_model  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context  # noqa: E402

REF_ATTN = {"gemma2": "eager", "gpt_oss": "eager"}  # soft-capping / sinks: transformers' eager path; others sdpa


def logprob_bound(config, row_tokens: int, dtype: torch.dtype, lp_scale: float) -> tuple[float, str]:
    """(bound on |rlsp - transformers| per logprob, its formula): see the module docstring."""
    text = text_model_config(config)
    layers, vocab = int(text.num_hidden_layers), int(text.vocab_size)
    n = max(text.hidden_size, getattr(text, "intermediate_size", 0) or 0, row_tokens, vocab)
    u_out = torch.finfo(dtype).eps / 2 if dtype in (torch.bfloat16, torch.float16) else 0.0
    u32 = torch.finfo(torch.float32).eps / 2
    scale = max(math.log(vocab), lp_scale)
    bound = 2 * (4 * layers + 1) * (u_out + math.sqrt(n) * u32) * scale
    formula = (f"2*(4L+1)*(u_out+sqrt(n)*2^-24)*max(log V, max|lp|): L={layers}, u_out={u_out:g}, n={n}, "
               f"V={vocab}, scale={scale:.4g}")
    return bound, formula


def _row_lengths(seq_len: int) -> list[int]:
    return [seq_len, 3 * seq_len // 4, seq_len // 2, seq_len // 4 + 1]


def _rows(lens: list[int], vocab: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random rows [B, L] of `lens` tokens (ids below the VL special tokens) and their mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.randint(1, vocab - 4, (len(lens), width), generator=gen)
    mask = (torch.arange(width)[None, :] < torch.tensor(lens)[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


def _packed_logprobs(model, ids: torch.Tensor, mask: torch.Tensor):
    """rlsp's logprobs [T] of the rows packed in one stream, and the pack."""
    packed = pack_sequences(ids, mask)
    ctx = build_sp_context(None, packed, *num_heads(text_model_config(model.lm.config)))
    out = model(packed.input_ids, packed.position_ids, packed.labels, ctx)
    return out["logprobs"], packed


def exactness(family: str, model, config, seq_len: int, device: str, dtype: torch.dtype) -> dict:
    """rlsp's packed forward against transformers' forward of each row alone (same weights, same dtype)."""
    auto = AutoModelForImageTextToText if family == "qwen2_5_vl" else AutoModelForCausalLM
    with torch.device(device):  # initialised where it runs: a CPU init of a mid-shape model takes tens of seconds
        ref = auto.from_config(config, attn_implementation=REF_ATTN.get(family, "sdpa"), dtype=dtype)
    ref.load_state_dict(model.lm.state_dict())
    lens = _row_lengths(seq_len)
    ids, mask = _rows(lens, text_model_config(config).vocab_size, device, seed=1)
    with torch.no_grad():
        got_T, packed = _packed_logprobs(model, ids, mask)
        got = got_T[packed.label_mask.bool()].float()
        want = []
        for b, n in enumerate(lens):
            logp = ref(input_ids=ids[b:b + 1, :n], use_cache=False).logits[0].float().log_softmax(-1)
            want.append(logp[:n - 1].gather(-1, ids[b, 1:n, None])[:, 0])
    del ref
    want = torch.cat(want)
    err = (got - want).abs()
    diff = float(err.max())
    bound, formula = logprob_bound(config, max(lens), dtype, float(want.abs().max()))
    # a MoE router may pick other experts for a token whose top-k scores tie within bf16 noise: that token's
    # logprob moves by O(1) while the rest stay at roundoff; the quantiles show which case a large maximum is
    quantiles = torch.quantile(err.double().cpu(), torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    return {"rows": lens, "max_abs_diff": diff, "median_abs_diff": quantiles[0], "p99_abs_diff": quantiles[1],
            "bound": bound, "bound_formula": formula, "exact_ok": bool(math.isfinite(diff) and diff <= bound)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fwd_bwd(model, tokens: int, seq_len: int, device: str) -> dict:
    """Time and peak memory of one forward+backward of rlsp's path at `tokens` (after one warm-up step)."""
    vocab = text_model_config(model.lm.config).vocab_size
    ids, mask = _rows([seq_len] * max(1, tokens // seq_len), vocab, device, seed=2)
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    try:
        for step in range(2):
            model.zero_grad(set_to_none=True)
            if device == "cuda" and step == 1:
                torch.cuda.reset_peak_memory_stats()
            _sync(device)
            t0 = time.perf_counter()
            logprobs_T, packed = _packed_logprobs(model, ids, mask)
            keep = packed.label_mask.to(logprobs_T.dtype)
            loss = -(logprobs_T * keep).sum() / keep.sum()
            loss.backward()
            loss = loss.detach()
            _sync(device)
            seconds = time.perf_counter() - t0
    except torch.OutOfMemoryError as exc:
        model.zero_grad(set_to_none=True)
        return {"oom": True, "error": str(exc).splitlines()[0][:200]}
    finite = bool(torch.isfinite(loss)) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                                 if p.grad is not None)
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {"fwd_bwd_s": round(seconds, 4), "peak_mem_gib": peak and round(peak, 3),
            "peak_extra_gib": peak and round(peak - base / 2**30, 3), "loss": loss.item(), "finite": finite}


def kernels(config, device: str, dtype: torch.dtype) -> str:
    """The kernels rlsp's path takes for this config on `device` in `dtype` (rlsp.models.attention's choices)."""
    text = text_model_config(config)
    probe = torch.empty(1, 1, 1, device=device, dtype=dtype)
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    found = []
    if linear_attention.LINEAR_LAYER_TYPE in types:
        found.append("fla" if linear_attention._use_fla(probe) else "torch")
    if types - {linear_attention.LINEAR_LAYER_TYPE}:
        explicit = getattr(text, "attn_logit_softcapping", None) or text.model_type == "gpt_oss"
        if explicit and not (attention._use_flash(probe) and text.model_type != "gpt_oss"):
            found.append("torch")
        elif attention._use_flash(probe):
            found.append("flash_attn")
        else:
            found.append("sdpa")
    return "+".join(dict.fromkeys(found))


class _WindowLayer(torch.nn.Module):
    layer_idx, num_key_value_groups, sinks = 0, 1, None


def window_memory(config, tokens: int, device: str, dtype: torch.dtype) -> dict:
    """Peak memory (CUDA) of forward+backward of one sliding-window layer of `config` over one row of tokens/2 and
    tokens tokens: O(tokens x window) keeps the ratio near 2."""
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    peaks = {}
    for n in (tokens // 2, tokens):
        packed = pack_sequences(torch.ones(1, n, dtype=torch.long), torch.ones(1, n, dtype=torch.long))
        ctx = build_sp_context(None, packed, hq, hkv)
        q, k, v = (torch.randn(1, h, n, d, device=device, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        out, _ = attention.ulysses_attention(_WindowLayer(), q, k, v, None, scaling=d**-0.5, sp_context=ctx,
                                             sliding_window=config.sliding_window)
        out.float().square().sum().backward()
        peaks[n] = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else None
        del q, k, v, out
    small, large = peaks[tokens // 2], peaks[tokens]
    ratio = large / small if small else None
    return {"window_mem": {"window": config.sliding_window, "tokens": list(peaks),
                           "peak_extra_gib": [p and round(p, 3) for p in peaks.values()],
                           "ratio": ratio and round(ratio, 3)},
            "window_linear": None if ratio is None else bool(ratio <= 2.5)}


def _stage(record: dict, name: str, fn, *args) -> None:
    """Run one measurement into `record`; an exception becomes a failure naming the stage, the rest still runs."""
    try:
        record.update(fn(*args))
    except Exception as exc:  # a failed stage must not hide the others' results
        record["failures"].append(f"{name}: {exc!r}"[:500])


def run_family(family: str, args, device: str, dtype: torch.dtype) -> dict:
    """One family's JSON record (building the model may raise: `main` reports that)."""
    config = family_config(family, small=device == "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = build_logprob_model(build_causal_lm_from_config(config, dtype=dtype))
    model.train()
    record = {"benchmark": "gpu_families", "family": family,
              "device": torch.cuda.get_device_name(0) if device == "cuda" else device, "torch": torch.__version__,
              "dtype": str(dtype).removeprefix("torch."), "tokens": args.tokens, "seq_len": args.seq_len,
              "kernel": kernels(config, device, dtype), "failures": []}
    failures = record["failures"]
    _stage(record, "exactness", exactness, family, model, config, args.seq_len, device, dtype)
    _stage(record, "fwd_bwd", fwd_bwd, model, args.tokens, args.seq_len, device)
    if family == "gemma3":
        _stage(record, "window_mem", window_memory, config, args.tokens, device, dtype)
    if record.get("exact_ok") is False:
        failures.append(f"max_abs_diff {record['max_abs_diff']:.4g} > bound {record['bound']:.4g}")
    if record.get("oom"):
        failures.append("out of memory in forward+backward")
    elif record.get("finite") is False:
        failures.append("non-finite loss or gradient")
    if record.get("window_linear") is False:
        failures.append(f"sliding-window memory grows {record['window_mem']['ratio']}x for 2x tokens")
    record["failures"] = record.pop("failures")  # last in the line, beside "ok"
    record["ok"] = not failures
    return record


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {FAMILIES}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="default: bfloat16 on cuda, float32 on cpu")
    args = p.parse_args(argv)
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        p.error(f"--families: unknown {unknown}; legal: {','.join(FAMILIES)}")
    if args.seq_len < 8 or args.tokens < args.seq_len:
        p.error(f"--seq-len={args.seq_len} must be >= 8 and <= --tokens={args.tokens}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the selected families; print one JSON line each; return the records."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_families.py: --device cuda but no CUDA device is visible; use --device cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    records = []
    for family in args.families.split(","):
        try:
            record = run_family(family, args, args.device, dtype)
        except Exception as exc:  # one family's failure must not hide the others' results
            record = {"benchmark": "gpu_families", "family": family, "ok": False, "failures": [repr(exc)[:500]]}
        print(json.dumps(record), flush=True)
        records.append(record)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return records


if __name__ == "__main__":
    sys.exit(0 if all(r["ok"] for r in main()) else 1)
