"""The training worker's code path on one rank of a real process group, with every engine option.

Each check builds the actor role from a config exactly as a policy worker does — `validate_config`
gives the layout, the process group is the one `rlsp.utils.device.backend_for` names (on CUDA a real
`cpu:gloo,cuda:nccl` group of one rank: it rejects a host tensor on a device path as eight ranks
would), the device is the one the worker resolves — then runs what a PPO step asks of it:
`compute_log_prob` (inference), `update_actor` (one optimizer step through the token-budget or
fixed micro-batches, metric reductions, gradient clipping) and `compute_log_prob` again; the
`rollout_sync` check adds the rollout role (HF generate: vLLM is not needed) and the weight sync. Prints one
JSON line per check:

    python benchmarks/engine_check.py                      # every check on this machine's device
    python benchmarks/engine_check.py --checks lora,bf16   # some of them
    python benchmarks/engine_check.py --model small        # a larger shape (GPU: memory and time mean something)

What a line asserts (`ok`, with `failures` naming what did not hold):
- the first logprobs equal the baseline check's (same weights, fp32 compute: <= 1e-4; bf16 compute:
  <= BF16_LOGPROB_TOL, see below), and are finite;
- the update's loss and gradient norm are finite, the trainable master weights are fp32, and the
  step moved the weights (sum |w| in fp64 changed);
- activation offload: on CUDA the forward moved at least the checkpointed layers' inputs to host
  memory (`perf/activation_offload_bytes` >= layers x tokens x hidden x bytes) and backward copied
  some back ahead of use (`activation_prefetch_bytes` > 0), on CPU it reports 0;
- FSDP parameter offload: on CUDA every parameter shard lives in host memory after the step;
- rollout_sync: after an update and the sync, the engine's logprobs of its greedy tokens equal the
  actor's (fp32, <= 1e-4), and on CUDA the sleeping engine has given its weights' memory back.

bf16 tolerance: bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3). A logprob is
logit - logsumexp(logits); with the tiny model's near-uniform logits (|logit| < 1) each of the two
carries a relative error of a few roundoffs after the model's ~10 bf16 roundings per layer, so 0.05
absolute holds with margin, while a wrong weight, head or mask moves logprobs by O(1).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rlsp.config.schema import RLSPConfig  # noqa: E402
from rlsp.config.validate import validate_config  # noqa: E402
from rlsp.data.batch import Batch  # noqa: E402
from rlsp.models.tiny import TinyModelSpec, build_tiny_model  # noqa: E402
from rlsp.utils.device import backend_for, device_for, resolve_device_type  # noqa: E402
from rlsp.workers.context import RoleContext  # noqa: E402
from rlsp.workers.roles.actor import ActorRole  # noqa: E402
from rlsp.workers.roles.rollout import RolloutRole  # noqa: E402

M, A = "actor_rollout_ref.model.", "actor_rollout_ref.actor."
FP32_LOGPROB_TOL = 1e-4
BF16_LOGPROB_TOL = 0.05
ROWS, MICRO = 8, 2

CHECKS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "bf16": {M + "dtype": "bfloat16"},
    "checkpointing": {M + "enable_gradient_checkpointing": True},
    "tiled_mlp": {M + "tiled_mlp.enabled": True, M + "tiled_mlp.num_shards": 3},
    "activation_offload": {M + "enable_gradient_checkpointing": True, M + "enable_activation_offload": True},
    "lora": {M + "lora_rank": 8, M + "lora_alpha": 16, M + "target_modules": "all-linear"},
    "logprob_chunk": {A + "logprob_chunk_size": 7},
    "token_budget": {A + "use_dynamic_bsz": True, A + "ppo_max_token_len_per_gpu": "<3 rows>"},
    "param_offload": {A + "fsdp_config.param_offload": True, "actor_rollout_ref.ref.fsdp_config.param_offload": True},
    "rollout_sync": {"actor_rollout_ref.rollout.name": "hf"},  # run_rollout_check
    "everything_bf16": {M + "dtype": "bfloat16", M + "enable_gradient_checkpointing": True,
                        M + "enable_activation_offload": True, M + "tiled_mlp.enabled": True,
                        A + "logprob_chunk_size": 7, A + "use_dynamic_bsz": True,
                        A + "ppo_max_token_len_per_gpu": "<3 rows>"},
}

# Model shapes: the CI/CPU one, and one large enough on a GPU for time and memory to mean something.
SHAPES = {
    "tiny": (TinyModelSpec(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
             (6, 10)),  # (prompt width, response width)
    "small": (TinyModelSpec(hidden_size=896, intermediate_size=4864, num_hidden_layers=8, num_attention_heads=14,
                            num_key_value_heads=2, max_position_embeddings=4096, vocab_size=32000), (512, 1024)),
}


def build_config(model_path: str, device_type: str, prompt: int, response: int, overrides: dict[str, Any]) -> Any:
    cfg = OmegaConf.structured(RLSPConfig)
    base = {"trainer.device": device_type, "trainer.n_gpus_per_node": 1, "actor_rollout_ref.model.path": model_path,
            "data.max_prompt_length": prompt, "data.max_response_length": response, "data.train_batch_size": ROWS // 2,
            "actor_rollout_ref.rollout.n": 2, A + "ppo_mini_batch_size": ROWS // 2,
            A + "ppo_micro_batch_size_per_gpu": MICRO, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": MICRO,
            A + "optim.lr": 1e-4, A + "optim.grad_clip": 1.0}
    budget = 3 * (prompt + response)  # a token budget that holds about three rows
    for key, val in {**base, **overrides}.items():
        OmegaConf.update(cfg, key, budget if val == "<3 rows>" else val)
    return cfg


def rollout_batch(vocab: int, prompt: int, response: int, seed: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses of ragged lengths, with the fields an update reads."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (ROWS, prompt + response), generator=g)
    mask = torch.zeros(ROWS, prompt + response, dtype=torch.long)
    for b in range(ROWS):
        p_len = max(1, prompt - (b * prompt) // (2 * ROWS))
        r_len = max(1, response - (3 * b * response) // (4 * ROWS))
        mask[b, prompt - p_len: prompt + r_len] = 1
    resp = mask[:, prompt:].float()
    old = (torch.randn(ROWS, response, generator=g) * 0.3 - math.log(vocab)) * resp
    ref = old + torch.randn(ROWS, response, generator=g) * 0.1 * resp
    adv = torch.randn(ROWS, response, generator=g) * resp
    return Batch.from_dict({"input_ids": input_ids * mask, "attention_mask": mask, "response_mask": resp,
                            "old_logprobs": old, "ref_logprobs": ref, "advantages": adv})


def _master_params(role: ActorRole) -> list[torch.Tensor]:
    """The sharded parameters the optimizer steps (the module's own list may hold the root's unsharded
    compute-dtype views after a forward: FSDP keeps the root unsharded until backward)."""
    return [p for group in role.engine.optimizer.param_groups for p in group["params"]]


def _master_dtypes(role: ActorRole) -> list[str]:
    return sorted({str(p.dtype) for p in _master_params(role)})


def _shards_on_host(role: ActorRole) -> bool:
    return all(getattr(p, "_local_tensor", p).device.type == "cpu" for p in _master_params(role))


def run_check(name: str, model_path: str, shape: str, device: torch.device,
              baseline: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor]:
    """One check on this rank (a process group must exist); -> (its JSON record, its first logprobs)."""
    spec, (prompt, response) = SHAPES[shape]
    cfg = build_config(model_path, device.type, prompt, response, CHECKS[name])
    layout = validate_config(cfg)
    batch = rollout_batch(_vocab(model_path), prompt, response)
    if device.type == "cuda":  # the peak of this check alone (the previous check's role is gone)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    role = ActorRole(RoleContext(cfg, 0, layout, device, pad_token_id=0))
    first = role.compute_log_prob(batch)["old_logprobs"]
    before = role.param_checksum()
    t0 = time.perf_counter()
    metrics = role.update_actor(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    moved = role.param_checksum() != before
    after = role.compute_log_prob(batch)["old_logprobs"]
    bf16 = cfg.actor_rollout_ref.model.dtype == "bfloat16"
    rec = {"check": name, "device": _device_name(device), "model": shape, "tokens": int(batch["attention_mask"].sum()),
           "logprob_max_abs_diff": None if baseline is None else float((first - baseline).abs().max()),
           "logprob_tol": BF16_LOGPROB_TOL if bf16 else FP32_LOGPROB_TOL,
           "pg_loss": metrics.get("actor/pg_loss"), "grad_norm": metrics.get("actor/grad_norm"),
           "master_dtypes": _master_dtypes(role), "weights_moved": moved,
           "policy_changed": float((after - first).abs().max()), "step_s": round(step_s, 4),
           "activation_offload_bytes": metrics.get("perf/activation_offload_bytes"),
           # of the last micro-batch: bytes its backward copied back one layer ahead of use (side stream)
           "activation_prefetch_bytes": role.engine.offload.stats.prefetched_bytes if role.engine.offload.active else None,
           "param_shards_on_host": _shards_on_host(role),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.type == "cuda" else None}
    rec["failures"] = _failures(rec, cfg, spec, first, device)
    rec["ok"] = not rec["failures"]
    del role
    return rec, first


def run_rollout_check(model_path: str, shape: str, device: torch.device) -> dict[str, Any]:
    """The rollout role beside the actor, as on a policy worker: one update, the weight sync into the
    (HF) rollout engine, a greedy generation (the engine wakes, then sleeps: on CUDA its weights leave
    the device), and the actor's logprobs of what it generated against the engine's own."""
    spec, (prompt, response) = SHAPES[shape]
    cfg = build_config(model_path, device.type, prompt, response, CHECKS["rollout_sync"])
    ctx = RoleContext(cfg, 0, validate_config(cfg), device, pad_token_id=0)
    rollout, actor = RolloutRole(ctx), ActorRole(ctx)
    batch = rollout_batch(_vocab(model_path), prompt, response)
    actor.update_actor(batch)  # the actor now differs from the weights the engine was built from
    rollout.load_weights(actor.rollout_weights(torch.float32))
    prompts = [row[row != 0].tolist()[-prompt:] for row in batch["input_ids"][:4, :prompt]]
    awake = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    rows = rollout.generate(Batch.from_dict({"prompt_index": torch.arange(len(prompts))}, meta={"prompt_ids": prompts}),
                            {"n": 1, "temperature": 0.0, "max_tokens": min(response, 8)})
    asleep = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    mask = rows["response_mask"]
    diff = float(((actor.compute_log_prob(rows)["old_logprobs"] - rows["rollout_logprobs"]).abs() * mask).max())
    rec = {"check": "rollout_sync", "device": _device_name(device), "model": shape, "generated": int(mask.sum()),
           "logprob_max_abs_diff_actor_vs_engine": diff, "logprob_tol": FP32_LOGPROB_TOL,
           "engine_sleep_freed_gib": round((awake - asleep) / 2**30, 3) if device.type == "cuda" else None}
    weights = sum(p.numel() * p.element_size() for p in rollout.engine.model.parameters())
    rec["failures"] = [f for f, bad in (
        (f"actor vs engine logprobs differ by {diff:.3g} > {FP32_LOGPROB_TOL} after the sync", not diff <= FP32_LOGPROB_TOL),
        ("nothing was generated", rec["generated"] == 0),
        ("the sleeping engine still holds its weights on the device", device.type == "cuda" and awake - asleep < weights // 2),
    ) if bad]
    rec["ok"] = not rec["failures"]
    return rec


def _failures(rec: dict[str, Any], cfg: Any, spec: TinyModelSpec, first: torch.Tensor, device: torch.device) -> list[str]:
    out = []
    if not torch.isfinite(first).all():
        out.append("non-finite logprobs")
    if rec["logprob_max_abs_diff"] is not None and not rec["logprob_max_abs_diff"] <= rec["logprob_tol"]:
        out.append(f"logprobs differ from the baseline by {rec['logprob_max_abs_diff']:.3g} > {rec['logprob_tol']}")
    for key in ("pg_loss", "grad_norm"):
        if rec[key] is None or not math.isfinite(rec[key]):
            out.append(f"{key}={rec[key]}")
    if rec["master_dtypes"] != ["torch.float32"]:
        out.append(f"trainable master weights are {rec['master_dtypes']}, not fp32")
    if not rec["weights_moved"]:
        out.append("the optimizer step left the weights unchanged")
    model = cfg.actor_rollout_ref.model
    if model.enable_activation_offload:
        least = spec.num_hidden_layers * MICRO * 2 * spec.hidden_size  # at least the layer inputs of 2 short rows
        want = least if device.type == "cuda" else 0
        got = rec["activation_offload_bytes"]
        if got is None or (got < want if want else got != 0):
            out.append(f"activation offload moved {got} bytes to host; expected {'>= ' if want else ''}{want} on {device.type}")
        if want and not rec["activation_prefetch_bytes"]:
            out.append("activation offload prefetched nothing ahead of backward")
    offload = cfg.actor_rollout_ref.actor.fsdp_config.param_offload
    if offload and device.type == "cuda" and not rec["param_shards_on_host"]:
        out.append("param_offload=true but parameter shards are on the device")
    return out


def _vocab(model_path: str) -> int:
    with open(os.path.join(model_path, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_checks(names: list[str], model_path: str, shape: str, device: torch.device) -> list[dict[str, Any]]:
    """Every named check, the baseline first (its logprobs are the reference), one JSON line each."""
    records, baseline = [], None
    for name in ["baseline", *[n for n in names if n != "baseline"]]:
        try:
            if name == "rollout_sync":
                rec, first = run_rollout_check(model_path, shape, device), None
            else:
                rec, first = run_check(name, model_path, shape, device, baseline)
        except Exception as exc:  # one broken option must not hide the others' results
            rec, first = {"check": name, "ok": False, "failures": [f"{type(exc).__name__}: {exc}"[:2000]]}, None
        if name == "baseline":
            baseline = first
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def init_one_rank(device_type: str) -> None:
    """A real process group of one rank with the backend the workers use."""
    init = tempfile.NamedTemporaryFile(prefix="rlsp_check_", delete=False).name
    os.unlink(init)
    dist.init_process_group(backend_for(device_type), init_method=f"file://{init}", rank=0, world_size=1,
                            timeout=timedelta(minutes=5))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, from {list(CHECKS)}")
    p.add_argument("--model", default="tiny", choices=list(SHAPES))
    args = p.parse_args()
    names = [n for n in args.checks.split(",") if n]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        p.error(f"unknown checks {unknown}; legal: {list(CHECKS)}")
    device_type = resolve_device_type(args.device)
    if device_type == "cuda":
        torch.cuda.set_device(0)
    init_one_rank(device_type)
    try:
        with tempfile.TemporaryDirectory(prefix="rlsp_check_model_") as tmp:
            path = build_tiny_model(SHAPES[args.model][0], tmp)
            records = run_checks(names, path, args.model, device_for(device_type))
    finally:
        dist.destroy_process_group()
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
