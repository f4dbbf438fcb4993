"""Turn generated samples into fixed-width padded rows (prompt left-padded to P, response right-padded to R).

Fixed widths make every worker's rows concatenable in the driver without re-padding.
"""

from __future__ import annotations

import torch


def build_rollout_rows(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    response_logprobs: list[list[float]],
    prompt_width: int,
    response_width: int,
    pad_id: int,
) -> dict[str, torch.Tensor]:
    """Rows [N, P+R]: input_ids, attention_mask, position_ids; [N, R]: response_mask, rollout_logprobs."""
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
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_logprobs": rollout_logprobs,
    }
