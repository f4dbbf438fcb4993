"""Bytes one decoder layer saves for backward when it runs with autograd on — what a checkpointed
layer holds while it is recomputed in backward — with HF's RMSNorms and with the lean RMSNorm, with
and without tiled MLP (CPU, one process).

Model: one random-init Qwen2 decoder layer shaped like Qwen2.5-0.5B (hidden 896, intermediate 4864,
14 q / 2 kv heads, head dim 64), one sequence of 4096 tokens, bf16 and fp32 (parameters in the same
dtype). Every tensor autograd saves during the layer's forward is recorded with
`torch.autograd.graph.saved_tensors_hooks`, counted once per distinct storage, parameters excluded;
`norms_mib` is the part saved inside the two norms (recorded while a norm's forward runs). The
layer's input gradient and every parameter gradient of the lean runs are compared with HF's
(max relative error, norm of the difference over the norm). Prints ONE JSON line.
Usage: python benchmarks/rmsnorm_memory.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Qwen2Config, Qwen2Model  # noqa: E402

from rlsp.models.rms_norm import apply_lean_rmsnorm  # noqa: E402
from rlsp.models.tiled_mlp import apply_tiled_mlp  # noqa: E402

TOKENS, HIDDEN, INTER = 4096, 896, 4864
MIB = 2**20


def _model(dtype: torch.dtype, lean: bool, tiles: int) -> Qwen2Model:
    config = Qwen2Config(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    model = Qwen2Model(config).to(dtype).train()
    if tiles:
        apply_tiled_mlp(model, tiles)
    if lean:
        apply_lean_rmsnorm(model)
    return model


def _run(model: Qwen2Model, x: torch.Tensor) -> tuple[int, int, dict[str, torch.Tensor], float]:
    """(saved bytes, of which inside the norms, gradients, seconds) of the layer's forward + backward."""
    layer = model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    in_norm: set[int] = set()
    norm_depth = [0]
    norms: list[nn.Module] = [layer.input_layernorm, layer.post_attention_layernorm]
    hooks = [n.register_forward_pre_hook(lambda *_: norm_depth.__setitem__(0, 1)) for n in norms]
    hooks += [n.register_forward_hook(lambda *_: norm_depth.__setitem__(0, 0)) for n in norms]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
            if norm_depth[0]:
                in_norm.add(ptr)
        return t

    x = x.detach().requires_grad_(True)
    position_ids = torch.arange(TOKENS)[None]
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rotary = model.rotary_emb(x, position_ids)
        out = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=rotary)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    seconds = time.perf_counter() - start
    for hook in hooks:
        hook.remove()
    grads = {"input": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return sum(seen.values()), sum(seen[p] for p in in_norm), grads, seconds


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> None:
    torch.set_num_threads(1)
    runs = []
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
        for tiles in (0, 4):
            reference = None
            for lean in (False, True):
                saved, norms, grads, seconds = _run(_model(dtype, lean, tiles), x)
                reference = reference or grads
                err = max(_rel(grads[n], g) for n, g in reference.items())
                runs.append({"dtype": str(dtype).removeprefix("torch."), "tiles": tiles, "lean_rmsnorm": lean,
                             "layer_saved_mib": round(saved / MIB, 2), "norms_mib": round(norms / MIB, 2),
                             "max_rel_grad_err_vs_hf": err, "fwd_bwd_s": round(seconds, 2)})
    print(json.dumps({"benchmark": "rmsnorm_memory", "device": "cpu", "torch": torch.__version__,
                      "model": f"qwen2 layer h{HIDDEN} i{INTER} 14q/2kv", "tokens": TOKENS, "runs": runs}))


if __name__ == "__main__":
    main()
