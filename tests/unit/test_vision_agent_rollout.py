"""Images in agent loops and partial rollouts, on the hf engine with a tiny random Qwen2.5-VL / Qwen3-VL and its real
processor (tests/tiny_vl.py, rlsp/models/tiny_vl.py: the PIL image processor, Qwen-VL vision tokens, chat
template).

* A 2-turn agent loop over a prompt with an image (rlsp.workers.agent_rollout.agent_generate, the real runner and
  server): the user turn between the two generations holds an `<|image_pad|>` as text, so turn 2's prefill must give
  the image features to the prompt's image tokens only (rlsp.rollout.hf_vision_turns). The engine's sampling
  logprobs of every policy token of the final rows equal the trainer's forward of those rows (VisionLogprobModel with
  the rows' multi_modal_inputs: the prompt's image tokens, multimodal rope over the whole trajectory) within
  tests/tolerances.py's bound for two forwards of the model; scored without its images, an image row's tokens of
  both turns are far off.
* A partial rollout (rlsp.rollout.segments, greedy, segments of 3 tokens) resumed with its images gives the tokens of
  the uninterrupted generation and its logprobs within the same bound, with an output layer that makes the model
  emit the image token (text, to the one-shot decode) so that the resumed prefills hold it too.
* A continued prompt that lost its image tokens is refused by name; the preflight takes agent loops and partial
  rollouts with images (only rollout engines other than hf are refused).
"""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from PIL import Image
from tiny_vl import IMAGE, write_tiny_vl
from tolerances import decoder_chain, logprob_tol
from transformers import AutoConfig, AutoTokenizer

from rlsp.agent.loop import AgentLoop, AgentLoopOutput, register_agent_loop
from rlsp.agent.runner import AgentRunner
from rlsp.config.compose import compose_config
from rlsp.data.batch import Batch
from rlsp.data.multimodal import Where, vision_prompt
from rlsp.data.vision_processor import image_run_errors, load_processor
from rlsp.engine.micro import prepare_micro_batch
from rlsp.models.family_checks import num_heads
from rlsp.models.loading import build_causal_lm_from_config
from rlsp.models.tiny_vl import write_tiny_vl_processor
from rlsp.models.vision_lm import VisionLogprobModel
from rlsp.rollout import SamplingConfig, build_rollout_engine
from rlsp.rollout.segments import generate_in_segments
from rlsp.workers.agent_rollout import agent_generate

FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # Qwen3-VL: deepstack features at the image positions
P, R = 40, 40  # row widths: prompt, whole trajectory
TURN = 6  # tokens per policy turn


@register_agent_loop("two_turn_image_test")
class TwoTurns(AgentLoop):
    """The policy writes up to TURN tokens; a user turn that holds an image token as text; the policy writes again."""

    async def run(self, sample):
        chat, server = self.env.chat, self.env.server
        end = min(chat.end_of_turn_ids())
        first = await server.generate(sample.prompt_ids, TURN)
        obs = ([] if first.ids and first.ids[-1] == end else [end]) + chat.observation_ids(
            [{"role": "user", "content": "<|image_pad|>!"}])
        second = await server.generate(sample.prompt_ids + first.ids + obs, TURN)
        ids = first.ids + obs + second.ids
        return AgentLoopOutput(list(sample.prompt_ids), ids, [1] * len(first.ids) + [0] * len(obs) + [1] * len(second.ids),
                               first.logprobs + [0.0] * len(obs) + second.logprobs, num_turns=2)


def _image(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.open(io.BytesIO(_png(Image.fromarray(pixels.numpy()))))


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    """(model dir, engine, processor, prompts: [(prompt_ids, multi_modal_inputs or None)])."""
    path = write_tiny_vl(request.param, str(tmp_path_factory.mktemp(request.param)))
    write_tiny_vl_processor(path)
    processor = load_processor("actor_rollout_ref.model.path", path)
    prompts = []
    for k, size in enumerate([(24, 16), (16, 16), None]):  # two prompts with an image, one without
        images = [] if size is None else [_image(*size, seed=k)]
        text = "<image>what?" if images else "no image"
        item = vision_prompt([{"role": "user", "content": text}], images, processor, Where("test", k))
        prompts.append((item["prompt_ids"], item["multi_modal_inputs"]))
    engine = build_rollout_engine("hf", path, dtype="float32", seed=0, max_model_len=P + R)
    return path, engine, processor, prompts


def _trainer_logprobs(path: str, engine, rows: Batch) -> torch.Tensor:
    """The trainer's forward of the rows with the engine's weights: log p(token c+1) at [B, c] (0 elsewhere)."""
    config = AutoConfig.from_pretrained(path)
    lm = build_causal_lm_from_config(config)
    lm.load_state_dict(engine.model.state_dict())
    micro = prepare_micro_batch(rows, P, None, *num_heads(config.text_config))
    packed = micro.packed
    with torch.no_grad():
        out = VisionLogprobModel(lm)(packed.input_ids, packed.position_ids, packed.labels, sp_context=micro.ctx,
                                     **micro.multi_modal_kwargs())
    keep = packed.label_mask[:packed.num_real]
    full_BL = torch.zeros(rows["input_ids"].shape[0], P + R - 1)
    full_BL[packed.row_index[keep], packed.col_index[keep]] = out["logprobs"][:packed.num_real][keep].float()
    return full_BL


def test_two_turn_trajectory_with_an_image_equals_the_trainers_forward(setup):
    path, engine, _, prompts = setup
    cfg = compose_config(overrides=["actor_rollout_ref.rollout.multi_turn.enable=true"])
    runner = AgentRunner(cfg.actor_rollout_ref.rollout, AutoTokenizer.from_pretrained(path))
    batch = Batch.from_dict({"prompt_index": torch.arange(len(prompts))}, meta={
        "prompt_ids": [p for p, _ in prompts], "multi_modal_inputs": [mm for _, mm in prompts],
        "agent_name": ["two_turn_image_test"] * len(prompts)})
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=R, seed=3)
    rows, meta = agent_generate(runner, engine, batch, sampling, (P, R), pad_id=0, version=0, on_boundary=None)
    assert [mm is prompts[i // 2][1] for i, mm in enumerate(meta["multi_modal_inputs"])] == [True] * 6
    rows = Batch.from_dict(rows, meta=meta)
    policy_BR = rows["response_mask"].bool()
    obs_BR = ~policy_BR & rows["attention_mask"][:, P:].bool()
    assert bool(((rows["input_ids"][:, P:] == IMAGE) & obs_BR).any(dim=1).all())  # the user turn's image token
    trainer_BR = _trainer_logprobs(path, engine, rows)[:, P - 1:]
    engine_BR = rows["rollout_logprobs"]
    config = AutoConfig.from_pretrained(path)
    tol = logprob_tol(decoder_chain(config), P + R, value_scale=float(trainer_BR[policy_BR].abs().max()))
    gap = float((engine_BR - trainer_BR)[policy_BR].abs().max())
    assert gap <= tol, (gap, tol)
    # The same row scored by the model without its images: each turn's logprobs move far more than the bound.
    b = 0
    real = rows["attention_mask"][b].bool()
    blind_R = torch.tensor(engine.prompt_logprobs(rows["input_ids"][b][real].tolist())[1:])[len(prompts[0][0]) - 1:]
    turn2 = int(obs_BR[b].nonzero().max()) + 1
    for turn in (slice(0, turn2), slice(turn2, len(blind_R))):
        mask = policy_BR[b, turn]
        blind_gap = float((blind_R[turn] - engine_BR[b, turn])[mask].abs().max())
        assert blind_gap > 100 * tol, (turn, blind_gap, tol)


@pytest.mark.parametrize("setup", ["qwen3_vl"], indirect=True)  # the prefill path is the agent test's, both families
def test_a_partial_rollout_resumed_with_its_images_equals_the_uninterrupted_generation(setup):
    path, engine, _, prompts = setup
    ids, images = [p for p, _ in prompts], [mm for _, mm in prompts]
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=9)
    head = engine.model.lm_head.weight.detach().clone()
    # The image token takes the place of the most frequent greedy token wherever that one's logit is positive.
    counts = Counter(t for r in engine.generate(ids, greedy, images=images).response_ids[:2] for t in r
                     if t not in engine.stop_ids)  # the rows with an image
    biased = head.clone()
    biased[IMAGE] = 1.05 * head[counts.most_common(1)[0][0]]
    engine.update_weights([("lm_head.weight", biased)])
    try:
        whole = engine.generate(ids, greedy, images=images)
        parts = generate_in_segments(engine, ids, greedy, 3, version=0, images=images)
    finally:
        engine.update_weights([("lm_head.weight", head)])
    # Image-token ids before a segment boundary: the resumed prefills hold them as text.
    assert any(IMAGE in r[:(len(r) - 1) // 3 * 3] for r in whole.response_ids[:2]), whole.response_ids
    assert parts.out.response_ids == whole.response_ids
    tol = logprob_tol(decoder_chain(AutoConfig.from_pretrained(path)), max(map(len, ids)) + greedy.max_tokens,
                      value_scale=max(abs(x) for r in whole.response_logprobs for x in r))
    gap = max(abs(a - b) for x, y in zip(parts.out.response_logprobs, whole.response_logprobs) for a, b in zip(x, y))
    assert gap <= tol, (gap, tol)


@pytest.mark.parametrize("setup", ["qwen3_vl"], indirect=True)
def test_continuations_without_their_images_and_other_engines_are_refused(setup):
    _, engine, _, prompts = setup
    with pytest.raises(ValueError, match=r"row 0 holds 0 image tokens \(id 60\) but its images need 6: a continued "
                                         "prompt must start with its row's prompt"):
        engine.generate([prompts[0][0][-5:]], SamplingConfig(max_tokens=1), images=[prompts[0][1]])
    base = ["actor_rollout_ref.rollout.multi_turn.enable=true", "async_training.partial_rollout=true"]
    assert image_run_errors(compose_config(overrides=[*base, "actor_rollout_ref.rollout.name=hf"])) == []
    assert image_run_errors(compose_config(overrides=[*base, "actor_rollout_ref.rollout.name=vllm"])) == [
        "actor_rollout_ref.rollout.name='vllm': prompts with images roll out with the hf engine (rlsp.rollout.hf_vision); "
        "legal: hf"]
