"""Turn generated samples into fixed-width padded rows (prompt left-padded to P, response right-padded to R).

Fixed widths make every worker's rows concatenable in the driver without re-padding. With routing replay R3 the
samples' MoE routes (rlsp.rollout.route_capture) become the row column the update replays (rlsp.engine.router_replay).
"""

from __future__ import annotations

import torch

from rlsp.engine.router_replay import ROUTE_DTYPE, ROUTES_KEY

NO_VERSION = -1  # token_version of padding


def build_rollout_rows(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    response_logprobs: list[list[float]],
    prompt_width: int,
    response_width: int,
    pad_id: int,
    token_versions: list[list[int]] | None = None,
    version: int = 0,
    response_masks: list[list[int]] | None = None,
    routes: list[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Rows [N, P+R]: input_ids, attention_mask, position_ids; [N, R]: response_mask, rollout_logprobs.

    `response_masks` (multi-turn: 1 on the policy's own tokens, 0 on tool output and template tokens)
    default to 1 on every response token; attention covers every token either way.

    With `token_versions` (the policy version that generated each response token) also [N, R]
    token_version (NO_VERSION on padding) and [N] policy_version / policy_version_max: the oldest and
    newest version among the sample's tokens (`version`, the engine's, for a sample without tokens).

    With `routes` (R3: each sample's [prompt + response tokens, L, K]) also ROUTES_KEY [N, P+R, L, K]."""
    n = len(prompt_ids)
    P, R = prompt_width, response_width
    input_ids = torch.full((n, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, P + R), dtype=torch.long)
    rollout_logprobs = torch.zeros((n, R), dtype=torch.float32)
    for i, (prompt, resp, lps) in enumerate(zip(prompt_ids, response_ids, response_logprobs)):
        if len(prompt) > P or len(resp) > R:
            raise ValueError(f"sample {i}: prompt {len(prompt)} > {P} or response {len(resp)} > {R} tokens")
        input_ids[i, P - len(prompt) : P] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, P - len(prompt) : P] = 1
        if resp:
            input_ids[i, P : P + len(resp)] = torch.tensor(resp, dtype=torch.long)
            attention_mask[i, P : P + len(resp)] = 1
            rollout_logprobs[i, : len(resp)] = torch.tensor(lps, dtype=torch.float32)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
    response_mask = attention_mask[:, P:].to(torch.float32)
    if response_masks is not None:
        for i, mask in enumerate(response_masks):
            if len(mask) != len(response_ids[i]):
                raise ValueError(f"sample {i}: {len(mask)} mask entries for {len(response_ids[i])} response tokens")
            if mask:
                response_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    rows = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_logprobs": rollout_logprobs,
    }
    if token_versions is not None:
        rows.update(_version_rows(token_versions, response_ids, R, version))
    if routes:
        rows[ROUTES_KEY] = _route_rows(routes, prompt_ids, response_ids, P, R)
    return rows


def _route_rows(routes: list[torch.Tensor], prompt_ids: list[list[int]], response_ids: list[list[int]], P: int,
                R: int) -> torch.Tensor:
    """[N, P+R, L, K]: each sample's routes under its tokens (the prompt ends at P, the response starts there), zeros
    where a row has no token, as the old-logprob pass of R2 records them."""
    layers, top_k = routes[0].shape[1:]
    out = torch.zeros((len(routes), P + R, layers, top_k), dtype=ROUTE_DTYPE)
    for i, (route, prompt, resp) in enumerate(zip(routes, prompt_ids, response_ids, strict=True)):
        if route.shape != (len(prompt) + len(resp), layers, top_k):
            raise ValueError(f"sample {i}: routes of shape {tuple(route.shape)} for {len(prompt)} prompt + {len(resp)} "
                             f"response tokens; expected ({len(prompt) + len(resp)}, {layers}, {top_k})")
        out[i, P - len(prompt) : P + len(resp)] = route.to(ROUTE_DTYPE)
    return out


def _version_rows(token_versions: list[list[int]], response_ids: list[list[int]], R: int,
                  version: int) -> dict[str, torch.Tensor]:
    n = len(token_versions)
    token_version = torch.full((n, R), NO_VERSION, dtype=torch.long)
    oldest, newest = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    for i, (versions, resp) in enumerate(zip(token_versions, response_ids)):
        if len(versions) != len(resp):
            raise ValueError(f"sample {i}: {len(versions)} token versions for {len(resp)} tokens")
        if versions:
            token_version[i, : len(versions)] = torch.tensor(versions, dtype=torch.long)
        oldest[i], newest[i] = min(versions, default=version), max(versions, default=version)
    return {"token_version": token_version, "policy_version": oldest, "policy_version_max": newest}
