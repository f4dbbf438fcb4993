"""One rank's training step of rlsp's engine path on CUDA: step time, peak memory, MFU; prints ONE JSON line.

The step is what an actor rank runs: the policy (`TokenLogprobModel`: HF decoder with rlsp_ulysses
attention + vocab-chunked logprob head) sharded with rlsp's FSDP2 `parallelize` (bf16 compute over
fp32 master weights, fp32 gradient reduction), AdamW from `build_optimizer`, one packed stream of
`--tokens` tokens (sequences of `--seq-len`), loss = mean token logprob, backward, grad clip, step.

    python benchmarks/gpu_train_step.py --tokens 32768                       # sp=1, one real rank (NCCL)
    python benchmarks/gpu_train_step.py --tokens 131072 --world 8 --sp 4     # one rank's share at sp=4 of 8

With `--world` > 1 the process joins a *fake* process group of that size (torch's `fake` backend:
collectives return at once without moving data), so it holds exactly one rank's share: parameters
and optimizer state sharded over the world, T/sp tokens outside attention, all T tokens for its
heads inside attention. Memory and compute are that rank's; communication time is not included and
the numbers (loss) are meaningless, so weight checks run only with `--world 1`.

Models (`--model`, random init): the Qwen2.5-0.5B shape (24 layers, hidden 896, 14 q / 2 kv heads of dim
64, MLP 4864, vocab 151,936, tied embeddings) and the Llama-3.1-8B shape (32 layers, hidden 4096, 32 q / 8
kv heads of dim 128, MLP 14336, vocab 128,256, untied; built in fp32 on the device before sharding, so it
needs ~32 GB free at start). `--tiled-mlp N` runs every MLP over N token tiles, `--act-offload` keeps what
the forward saves in host memory until backward (as the engine's `enable_activation_offload`), and
`--mem-cap-gib` caps this process's allocator (a larger card standing for a smaller one). MFU = 6·N·T / step time / peak bf16 FLOP/s (`--peak-tflops`,
989 for H100 SXM dense), counted for this rank's 1/sp of the stream; `mfu_with_attn` adds causal
attention FLOPs, 6·L·Hq·D·sum(seq_len^2) (forward 4·seq^2·D per head halved by causality, backward 2x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, Qwen2Config  # noqa: E402

from rlsp.config.layout import RoleLayout, World  # noqa: E402
from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.engine.offload import ActivationOffload  # noqa: E402
from rlsp.engine.optim import OptimSettings, build_optimizer  # noqa: E402
from rlsp.engine.parallelize import parallelize  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.models.tiled_mlp import apply_tiled_mlp  # noqa: E402
from rlsp.parallel.mesh import build_parallel_dims  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context, shard_for_rank  # noqa: E402
from rlsp.utils.device import backend_for  # noqa: E402

MODELS = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                         rope_theta=1_000_000.0, max_position_embeddings=1 << 20),
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                        rope_theta=500_000.0, max_position_embeddings=1 << 24),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                  max_position_embeddings=1 << 20),
    "smoke-llama": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                        max_position_embeddings=1 << 20),
}
CONFIG_CLASSES = {"llama3.1-8b": LlamaConfig, "smoke-llama": LlamaConfig}  # the rest: Qwen2Config


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, required=True, help="packed stream length T (all sp ranks together)")
    p.add_argument("--seq-len", type=int, default=0, help="sequence length inside the stream (0: one sequence)")
    p.add_argument("--world", type=int, default=1, help="ranks simulated with the fake backend when > 1")
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing of every decoder layer")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per vocab-projection chunk of the logprob head")
    p.add_argument("--profile", action="store_true", help="add the 15 costliest GPU ops of one more step")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiled-mlp", type=int, default=0, help="token tiles per MLP call (0: the model's own MLP)")
    p.add_argument("--act-offload", action="store_true",
                   help="activation offload: what the forward saves waits in host memory (needs --grad-ckpt to matter)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (before sharding; use --warmup 2 so compilation is not timed)")
    p.add_argument("--mem-cap-gib", type=float, default=0.0,
                   help="cap this process's CUDA allocator at this many GiB (e.g. 79 to stand for an 80 GB card)")
    return p.parse_args()


def _init_world(world: int, device: str) -> None:
    if world == 1:
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _stream(tokens: int, seq_len: int, vocab: int, sp: int) -> object:
    seq_len = seq_len or tokens
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    width = max(lens)
    gen = torch.Generator().manual_seed(0)
    ids_BL = torch.randint(1, vocab, (len(lens), width), generator=gen)
    mask_BL = (torch.arange(width)[None, :] < torch.tensor(lens)[:, None]).long()
    return pack_sequences(ids_BL, mask_BL, pad_to_multiple=sp), lens


def _flops(n_params: int, cfg: dict, lens: list[int]) -> tuple[float, float]:
    dense = 6.0 * n_params * sum(lens)
    attn = 6.0 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"] * sum(n * n for n in lens)
    return dense, dense + attn


def _profile(step) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:15]
    return [(e.key[:60], round(e.self_device_time_total / 1e3, 2)) for e in rows]


def _build(a: argparse.Namespace, device: torch.device) -> tuple:
    """The sharded policy, its optimizer and one training step over this rank's share of the stream."""
    cfg = MODELS[a.model]
    dims = build_parallel_dims(RoleLayout(World(1, dist.get_world_size()), ulysses=a.sp), device.type)
    torch.manual_seed(0)
    with device:
        lm = build_causal_lm_from_config(CONFIG_CLASSES.get(a.model, Qwen2Config)(**cfg), dtype=torch.float32)
    if a.tiled_mlp:
        apply_tiled_mlp(lm.model, a.tiled_mlp)
    if a.grad_ckpt:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.compile:
        for layer in lm.model.layers:
            layer.compile()
    n_params = sum(p.numel() for p in lm.parameters())
    model = parallelize(TokenLogprobModel(lm, chunk_size=a.chunk), dims, getattr(torch, a.dtype))
    optimizer, _ = build_optimizer(model, OptimSettings(lr=a.lr, grad_clip=1.0))
    offload = ActivationOffload(a.act_offload, model, device)
    packed, lens = _stream(a.tokens, a.seq_len, cfg["vocab_size"], a.sp)
    ctx = build_sp_context(dims.ulysses_group, packed, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    ids_S, pos_S, lab_S = (shard_for_rank(x, ctx).to(device) for x in (packed.input_ids, packed.position_ids, packed.labels))
    mask_S = shard_for_rank(packed.label_mask, ctx).to(device).float()
    n_label = float(packed.label_mask.sum())
    offloaded: list[int] = []

    def step() -> float:
        ctx.cache.clear()
        with offload() as stats:  # the forward only, as the engine does: backward's recomputations stay
            out = model(ids_S, pos_S, lab_S, ctx)
            loss = -(out["logprobs"] * mask_S).sum() / n_label
        offloaded.append(stats.bytes)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return model, step, n_params, ctx.local_len, lens, offloaded


def _run_steps(a: argparse.Namespace, step, cuda: bool) -> tuple[list[float], list[float], list[float]]:
    """(warm-up losses, timed losses, timed seconds); peak memory is reset after the warm-up."""
    warm_losses = [step() for _ in range(a.warmup)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        losses.append(step())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return warm_losses, losses, times


def _weight_checks(model, before: dict, losses: list[float]) -> dict:
    moved = sum(int((p.detach().to_local() != before[n]).sum()) for n, p in model.named_parameters())
    total = sum(t.numel() for t in before.values())
    return {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
            "loss_finite": all(x == x and abs(x) != float("inf") for x in losses),
            "frac_weights_moved": round(moved / total, 4),
            "master_dtype": sorted({str(p.dtype) for p in model.parameters()})}


def main() -> None:
    a = _args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        if a.mem_cap_gib:  # a process-level allocator limit, not a device setting
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.mem_cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    _init_world(a.world, device.type)
    model, step, n_params, local_len, lens, offloaded = _build(a, device)
    before = {n: p.detach().to_local().clone() for n, p in model.named_parameters()} if a.world == 1 else {}
    result = {"benchmark": "gpu_train_step", "model": a.model, "params": n_params, "tokens": a.tokens,
              "seq_len": a.seq_len or a.tokens, "world": a.world, "sp": a.sp, "local_tokens": local_len,
              "grad_ckpt": a.grad_ckpt, "compile": a.compile, "tiled_mlp": a.tiled_mlp, "act_offload": a.act_offload,
              "mem_cap_gib": a.mem_cap_gib or None, "dtype": a.dtype,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
    try:
        warm_losses, losses, times = _run_steps(a, step, cuda)
        if a.profile:
            result["top_ops_ms"] = _profile(step)
    except torch.OutOfMemoryError as e:
        result.update(oom=True, error=str(e).splitlines()[0][:200])
        print(json.dumps(result), flush=True)
        return
    step_s = statistics.median(times)
    dense, with_attn = _flops(n_params, MODELS[a.model], lens)
    rank_dense, rank_attn = dense / a.sp, with_attn / a.sp  # one rank does 1/sp of its sp group's work
    result.update(
        oom=False, step_s=round(step_s, 4), steps=a.steps,
        tokens_per_s_rank=round(a.tokens / a.sp / step_s, 1),
        peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        mfu=round(rank_dense / step_s / (a.peak_tflops * 1e12), 4),
        mfu_with_attn=round(rank_attn / step_s / (a.peak_tflops * 1e12), 4),
        offloaded_gib=round(max(offloaded) / 2**30, 3) if a.act_offload else None,
    )
    if a.world == 1:
        result.update(_weight_checks(model, before, [*warm_losses, *losses]))
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
