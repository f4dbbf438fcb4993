"""Token logprob + entropy head on CUDA: rlsp's vocab-chunked version vs full logits; ONE JSON line.

    python benchmarks/gpu_logprob.py --tokens 32768 --vocab 151936 --hidden 896

Inputs: final hidden states [T, H] and the output layer [V, H] in bf16, both requiring grad (the
actor's case: tied embeddings train). `chunked` is `rlsp.models.logprobs.compute_token_logprobs`
(chunks of `--chunk` tokens, fp32 reductions, logits recomputed in backward); `naive` materialises
the [T, V] logits, upcasts them to fp32 and takes log_softmax / softmax (what a plain HF-logits
trainer does). Reported per implementation: forward+backward time and the peak memory it adds over
its inputs; and the largest logprob / entropy / gradient difference between the two (when both fit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rlsp.models.logprobs import compute_token_logprobs  # noqa: E402


def _naive(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden @ weight.t()).float()
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, labels[:, None])[:, 0], entropy


def _run(name: str, fn, hidden, weight, labels, grad_lp, grad_ent, cuda: bool) -> dict:
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        lp, ent = fn(h, w, labels)
        torch.autograd.backward([lp, ent], [grad_lp, grad_ent])
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    except torch.OutOfMemoryError as e:
        return {"impl": name, "oom": True, "error": str(e).splitlines()[0][:200]}
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    return {"impl": name, "oom": False, "fwd_bwd_s": round(seconds, 4), "peak_extra_gib": peak and round(peak, 3),
            "_out": (lp.detach(), ent.detach(), h.grad, w.grad)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    cuda = a.device == "cuda"
    gen = torch.Generator(device=a.device).manual_seed(0)
    hidden = torch.randn(a.tokens, a.hidden, device=a.device, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(a.vocab, a.hidden, device=a.device, generator=gen) * 0.02).to(torch.bfloat16)
    labels = torch.randint(0, a.vocab, (a.tokens,), device=a.device, generator=gen)
    grad_lp = torch.randn(a.tokens, device=a.device, generator=gen)
    grad_ent = torch.randn(a.tokens, device=a.device, generator=gen)

    def chunked(h, w, y):
        return compute_token_logprobs(h, w, y, chunk_size=a.chunk, with_entropy=True)

    runs = {}
    for name, fn in (("chunked", chunked), ("naive", _naive)):
        _run(name, fn, hidden, weight, labels, grad_lp, grad_ent, cuda)  # warm-up (kernels, allocator)
        runs[name] = _run(name, fn, hidden, weight, labels, grad_lp, grad_ent, cuda)
    result = {"benchmark": "gpu_logprob", "tokens": a.tokens, "vocab": a.vocab, "hidden": a.hidden, "chunk": a.chunk,
              "device": torch.cuda.get_device_name(0) if cuda else a.device, "torch": torch.__version__}
    if "_out" in runs["chunked"] and "_out" in runs["naive"]:
        (lp1, e1, h1, w1), (lp2, e2, h2, w2) = runs["chunked"]["_out"], runs["naive"]["_out"]
        result.update(max_logprob_diff=float((lp1 - lp2).abs().max()), max_entropy_diff=float((e1 - e2).abs().max()),
                      grad_hidden_rel_diff=float((h1.float() - h2.float()).abs().max() / h2.float().abs().max()),
                      grad_weight_rel_diff=float((w1.float() - w2.float()).abs().max() / w2.float().abs().max()))
    for name, r in runs.items():
        r.pop("_out", None)
        result[name] = r
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
