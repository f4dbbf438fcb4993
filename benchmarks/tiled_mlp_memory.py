"""Bytes saved for backward with and without tiled MLP, with and without gradient checkpointing, and
what activation offload copies to host memory (CPU, one process).

Model: random-init Qwen2 decoder, hidden 256, intermediate 1024, 8 q / 4 kv heads (head dim 32),
4 layers; one sequence of 2048 tokens; fp32. Every tensor autograd saves during the forward is
recorded with `torch.autograd.graph.saved_tensors_hooks`, counted once per distinct storage,
parameters excluded (as in activation_memory.py). `layer_recompute_mib` is what one layer saves when
run with autograd on: under gradient checkpointing, what its recomputation holds in backward (with
tiled MLP plus one tile's four [S/n, I] intermediates while that tile is back-propagated, reported
as `tile_transient_mib`). The offload run uses `offload_saved_tensors` with device=cpu (copies into
fresh host buffers) to count what the hooks move. Gradients of every run are compared with the
plain run (max relative error). Prints ONE JSON line. Usage: python benchmarks/tiled_mlp_memory.py
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2Model  # noqa: E402

from rlsp.engine.offload import offload_saved_tensors  # noqa: E402
from rlsp.models.tiled_mlp import apply_tiled_mlp  # noqa: E402

TOKENS, HIDDEN, INTER, LAYERS = 2048, 256, 1024, 4
MIB = 2**20


def _model(tiles: int, checkpointing: bool, base: Qwen2Model) -> Qwen2Model:
    model = copy.deepcopy(base).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tiles:
        apply_tiled_mlp(model, tiles)
    return model


def _run(model: Qwen2Model, ids: torch.Tensor) -> tuple[int, dict[str, torch.Tensor], float]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids).last_hidden_state
    out.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return sum(seen.values()), grads, time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1024, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    base = Qwen2Model(config)
    ids = torch.randint(0, 1024, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    runs, reference = [], None
    for tiles, checkpointing in ((0, False), (4, False), (16, False), (0, True), (4, True)):
        saved, grads, seconds = _run(_model(tiles, checkpointing, base), ids)
        reference = reference or grads
        err = max(float((grads[n] - g).norm() / g.norm()) for n, g in reference.items())
        runs.append({"tiles": tiles, "checkpointing": checkpointing, "saved_mib": saved / MIB,
                     "layer_recompute_mib": None, "tile_transient_mib": 4 * TOKENS * INTER * 4 / max(tiles, 1) / MIB
                     if tiles else None, "max_rel_grad_err": err, "fwd_bwd_s": round(seconds, 2)})
    for run in runs:
        same = next(r for r in runs if r["tiles"] == run["tiles"] and not r["checkpointing"])
        if run["checkpointing"]:  # a layer's saves incl. its input: (all - what checkpointing keeps) / L + [S, H]
            run["layer_recompute_mib"] = (same["saved_mib"] - runs[3]["saved_mib"]) / LAYERS + TOKENS * HIDDEN * 4 / MIB
    model = _model(0, True, base)
    with offload_saved_tensors(model, torch.device("cpu")) as stats:
        model(input_ids=ids)
    print(json.dumps({"benchmark": "tiled_mlp_memory", "device": "cpu", "torch": torch.__version__,
                      "model": f"qwen2 h{HIDDEN} i{INTER} 8q/4kv L{LAYERS}", "tokens": TOKENS, "runs": runs,
                      "offload_with_checkpointing": {"tensors": stats.tensors, "mib": stats.bytes / MIB,
                                                     "kept_parameters": stats.kept}}))


if __name__ == "__main__":
    main()
