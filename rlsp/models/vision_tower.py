"""The vision-language input path every head model over a HF vision-language model shares: the policy's
(`rlsp.models.vision_lm.VisionLogprobModel`) and the critic's (`rlsp.models.value.VisionValueModel`).

`VisionInputs` is a mixin for a head model that exposes `vl_model`, the HF vision-language base model (`visual`, the
vision tower; `language_model`, the text decoder; `get_rope_index`; the top-level config with `image_token_id`).
`vision_inputs` turns this rank's shard of a packed stream and the micro-batch's images (`MultiModalRows`) into the
text decoder's inputs:
  1. the stream's 3-D rope positions [3, T] come from the model's own `get_rope_index`, row by row on the full
     stream, and are sliced to the rank's shard like the 1-D positions (`shard_for_rank`);
  2. the vision tower runs once per image: the images are spread over the ranks that share the stream (Ulysses x
     ring), balanced by patches; each rank encodes its share, and the visual tokens of all ranks are all-gathered
     (an autograd function: backward sums the gradient over those ranks and keeps the rank's own rows);
  3. the rank's input embeddings [S, H] take the visual tokens at its image placeholders; the text model runs on
     them with position_ids [3, 1, S] and the SP context; Qwen3-VL's deepstack features are added at the rank's own
     visual positions (`visual_pos_masks` of its shard).
While the tower trains (not frozen), a rank without an image of its own encodes a blank image whose output is added
times zero: every rank then holds a gradient (zeros) for every tower parameter, which FSDP2's reduce-scatter and the
optimizer need alike (a layout must not change which parameters AdamW steps).

Legend: T packed stream, S local tokens, H text hidden size, V visual tokens of the stream, F visual features per
token (H, times 1 + the deepstack levels), R ranks sharing the stream.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlsp.models.vision_inputs import TOWER_FAMILIES, MultiModalRows, StreamImages, rope_positions, stream_images
from rlsp.parallel.ulysses import SPContext, shard_for_rank


def _sp_groups(ctx: SPContext) -> list[dist.ProcessGroup]:
    """The groups whose ranks hold the same rows: Ulysses, then ring (rank index ring_rank * ulysses + ulysses_rank)."""
    return [g for g in (ctx.group, None if ctx.ring is None else ctx.ring.group) if g is not None]


class _GatherOverSP(torch.autograd.Function):
    """[n, F] per rank -> [R * n, F] in rank order; backward sums the gradient over the ranks, keeps the rank's rows."""

    @staticmethod
    def forward(fctx: Any, x_nF: torch.Tensor, groups: list[dist.ProcessGroup], rank: int) -> torch.Tensor:
        fctx.groups, fctx.rank, fctx.n = groups, rank, x_nF.shape[0]
        out = x_nF.contiguous()
        for group in groups:
            parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, out, group=group)
            out = torch.stack(parts)
        return out.reshape(-1, x_nF.shape[-1])

    @staticmethod
    def backward(fctx: Any, grad_RnF: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad_RnF = grad_RnF.contiguous()
        for group in fctx.groups:
            dist.all_reduce(grad_RnF, group=group)
        return grad_RnF[fctx.rank * fctx.n:(fctx.rank + 1) * fctx.n], None, None


def assign_images(patches: list[int], ranks: int) -> list[int]:
    """Owner rank of each image: largest first to the least-loaded rank (ties: the lower rank); the same on every rank."""
    load, owner = [0] * ranks, [0] * len(patches)
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + patches[i]
    return owner


def check_tower_family(model: nn.Module, what: str) -> None:
    """`model` (a HF vision-language model or base model) must be one of TOWER_FAMILIES."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in TOWER_FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not a vision-language family rlsp trains; legal: "
                         f"{list(TOWER_FAMILIES)} ({what}; qwen3_5 / qwen3_5_moe with images: load with "
                         "vision_tower=True)")


class VisionInputs:
    """Mixin: the decoder inputs of a head model over a HF vision-language base model (`vl_model`); see the module
    docstring. Subclasses set `vl_model`; `decoder` and `visual` follow from it."""

    @property
    def vl_model(self) -> nn.Module:
        raise NotImplementedError

    @property
    def decoder(self) -> nn.Module:
        return self.vl_model.language_model

    @property
    def visual(self) -> nn.Module:
        return self.vl_model.visual

    def freeze_tower(self) -> None:
        """No gradients for the tower, hence no optimizer state (build_optimizer takes requires_grad ones)."""
        self.visual.requires_grad_(False)

    def check_no_tp(self) -> None:
        if getattr(self, "tp_info", None) is not None:
            raise ValueError("tensor parallelism is not supported for vision-language models; legal: "
                             "tensor_model_parallel_size=1 (use Ulysses / ring sequence parallelism)")

    def vision_inputs(self, input_ids_S: torch.Tensor, position_ids_S: torch.Tensor, ctx: SPContext,
                      multi_modal: MultiModalRows | None) -> dict[str, Any]:
        """The text decoder's inputs for this rank's shard: inputs_embeds [1, S, H] with the visual tokens placed,
        position_ids [3, 1, S] (and Qwen3-VL's deepstack inputs); `multi_modal` None: text-only rows."""
        images = None if multi_modal is None else stream_images(
            multi_modal.entries, multi_modal.packed, self.vl_model.config.image_token_id,
            self.visual.config.spatial_merge_size, multi_modal.prompt_len)
        return self._decoder_inputs(input_ids_S, position_ids_S, ctx, images)

    def _tower_trains(self) -> bool:
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.visual.parameters())

    def _decoder_inputs(self, input_ids_S: torch.Tensor, position_ids_S: torch.Tensor, ctx: SPContext,
                        images: StreamImages | None) -> dict[str, Any]:
        embeds_SH = self.decoder.embed_tokens(input_ids_S)
        if images is None:
            if self._tower_trains():  # every tower parameter gets a (zero) gradient on every rank
                embeds_SH = embeds_SH + 0.0 * self._encode_blank(embeds_SH).sum()
            return {"inputs_embeds": embeds_SH[None], "position_ids": position_ids_S.expand(3, -1)[:, None]}
        positions_3T = rope_positions(self.vl_model, images)
        positions_3S = shard_for_rank(positions_3T.T, ctx).T.to(input_ids_S.device)
        feats_VF = self._encode_stream(images, ctx, embeds_SH)
        mask_T = images.image_mask_T
        local_T = ctx.local_index
        mask_S = mask_T[local_T]
        rows = (mask_T.cumsum(0) - 1)[local_T][mask_S]
        mine_vF = feats_VF[rows.to(feats_VF.device)]
        H = embeds_SH.shape[-1]
        mask_S = mask_S.to(embeds_SH.device)
        embeds_SH = embeds_SH.masked_scatter(mask_S[:, None], mine_vF[:, :H])
        inputs = {"inputs_embeds": embeds_SH[None], "position_ids": positions_3S[:, None]}
        if mine_vF.shape[1] > H:  # Qwen3-VL's deepstack: one [v, H] block per level, at the rank's visual tokens
            inputs["visual_pos_masks"] = mask_S[None]
            inputs["deepstack_visual_embeds"] = list(mine_vF[:, H:].split(H, dim=1))
        return inputs

    def _run_tower(self, pixel_values: torch.Tensor, grid_thw_N3: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Visual tokens [v, F] of the images (merged tokens, then each deepstack level's, side by side)."""
        out = self.visual(pixel_values.to(like.device, like.dtype), grid_thw=grid_thw_N3.to(like.device),
                          return_dict=True)
        deep = list(getattr(out, "deepstack_features", None) or [])
        return torch.cat([out.pooler_output, *deep], dim=-1).to(like.dtype)

    def _encode_blank(self, like: torch.Tensor) -> torch.Tensor:
        cfg = self.visual.config
        merge = cfg.spatial_merge_size
        pixels = torch.zeros(merge * merge, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2)
        return self._run_tower(pixels, torch.tensor([[1, merge, merge]]), like)

    def _encode_stream(self, images: StreamImages, ctx: SPContext, like: torch.Tensor) -> torch.Tensor:
        """Visual tokens [V, F] of every image of the stream, in stream order; each rank encodes its share."""
        merge = self.visual.config.spatial_merge_size
        tokens = (images.grid_thw_N3.prod(-1) // merge**2).tolist()
        ranks, me = ctx.ulysses_size * ctx.ring_size, ctx.ring_rank * ctx.ulysses_size + ctx.ulysses_rank
        owner = assign_images([p.shape[0] for p in images.pixel_values], ranks)
        mine = [i for i in range(len(owner)) if owner[i] == me]
        if mine:
            feats_nF = self._run_tower(torch.cat([images.pixel_values[i] for i in mine]), images.grid_thw_N3[mine], like)
        else:
            blank = self._encode_blank(like) if self._tower_trains() else None
            width = like.shape[-1] * (1 + len(getattr(self.visual.config, "deepstack_visual_indexes", None) or []))
            feats_nF = like.new_zeros(0, width) + (0.0 * blank.sum() if blank is not None else 0.0)
        if ranks == 1:
            return feats_nF
        per_rank = [sum(tokens[i] for i in range(len(owner)) if owner[i] == r) for r in range(ranks)]
        n = max(per_rank)
        padded_nF = torch.cat([feats_nF, feats_nF.new_zeros(n - feats_nF.shape[0], feats_nF.shape[1])])
        gathered_RnF = _GatherOverSP.apply(padded_nF, _sp_groups(ctx), me)
        index, offset = [], [r * n for r in range(ranks)]
        for i, owner_i in enumerate(owner):  # images in stream order, each from its owner's rows
            index += range(offset[owner_i], offset[owner_i] + tokens[i])
            offset[owner_i] += tokens[i]
        return gathered_RnF[torch.tensor(index, device=gathered_RnF.device)]
