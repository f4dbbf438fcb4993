"""data.apply_chat_template_kwargs (verl's key): every chat-template render of the policy's prompts gets them —
the datasets (training and validation: one PromptDataset each), rlsp.check's prompt counting, and the agent
loops' token-exact turns (rlsp.agent.chat). tests/data/chat_templates/thinking_switch.jinja reads the template
variable enable_thinking (as Qwen3's template does): false opens every assistant turn with "think: off\\n"."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf
from test_verl_commands import _problems, build_local, localize
from transformers import AutoTokenizer

from rlsp.agent.chat import ChatTokens
from rlsp.check import main as check_main
from rlsp.config.compose import compose_collecting, parse_command_line
from rlsp.data.dataset import PromptDataset, chat_template_kwargs, prompt_report
from rlsp.models.tokenizer import build_char_tokenizer

TEMPLATE = (Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "thinking_switch.jinja").read_text()
OFF = {"enable_thinking": False}
OPENING = "think: off\n"
KWARG = "+data.apply_chat_template_kwargs.enable_thinking=false"


@pytest.fixture()
def tok():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _parquet(tmp_path) -> str:
    path = str(tmp_path / "p.parquet")
    pd.DataFrame({"prompt": [[{"role": "user", "content": "what is 2+3?"}], [{"role": "user", "content": "add 4 and 5"}]],
                  "data_source": ["x", "x"], "reward_model": [{"ground_truth": "5"}, {"ground_truth": "9"}]}
                 ).to_parquet(path)
    return path


def test_datasets_and_prompt_counts_render_with_the_kwargs(tmp_path, tok):
    path = _parquet(tmp_path)
    plain, off = PromptDataset(path, tok, 64), PromptDataset(path, tok, 64, template_kwargs=OFF)
    for a, b in zip(plain, off):
        assert a["prompt_text"].endswith("<|im_start|>assistant\n") and b["prompt_text"] == a["prompt_text"] + OPENING
        assert b["prompt_ids"] == a["prompt_ids"] + tok.encode(OPENING, add_special_tokens=False)
    counted = prompt_report([path], tok, template_kwargs=OFF).lengths
    assert counted == [len(item["prompt_ids"]) for item in off] != prompt_report([path], tok).lengths
    assert PromptDataset(path, tok, 64, template_kwargs={"enable_thinking": True})[0] == plain[0]


def test_agent_turns_render_with_the_kwargs(tok):
    user = [{"role": "user", "content": "add 2 and 3"}]
    plain, off = ChatTokens(tok), ChatTokens(tok, template_kwargs=OFF)
    assert off.prompt_ids(user) == plain.prompt_ids(user) + tok.encode(OPENING, add_special_tokens=False)
    # token-exact turns: prompt + reply + observation == the template's render of the whole conversation
    reply = off.assistant_ids("it is 5")
    obs = off.observation_ids([{"role": "tool", "content": "5"}])
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": "it is 5"}, {"role": "tool", "content": "5"}],
                                    tokenize=False, add_generation_prompt=True, **OFF)
    assert tok.decode(off.prompt_ids(user) + reply + obs) == whole
    assert off.end_of_turn_ids() == plain.end_of_turn_ids() == {tok.convert_tokens_to_ids("<|im_end|>")}


def test_the_key_composes_and_reserved_arguments_are_refused():
    cfg, problems = compose_collecting(parse_command_line(["--config-name", "verl", KWARG]))
    assert not problems and chat_template_kwargs(cfg) == OFF
    assert chat_template_kwargs(OmegaConf.create({"data": {"apply_chat_template_kwargs": {}}})) == {}
    from rlsp.config.validate_verl import check_verl_keys  # noqa: PLC0415

    cfg, _ = compose_collecting(parse_command_line(["--config-name", "verl", "+data.apply_chat_template_kwargs.tokenize=true"]))
    errors: list[str] = []
    check_verl_keys(cfg, errors)
    assert any("data.apply_chat_template_kwargs sets ['tokenize']" in e and "enable_thinking" in e for e in errors), errors


def _longest(out: str, split: str) -> int:
    return int(re.search(rf"{split}: 1 file\(s\), \d+ rows, prompts up to (\d+) tokens", out).group(1))


def test_rlsp_check_counts_prompts_with_the_kwargs(tmp_path, capsys):
    local = build_local(tmp_path, 256)
    tokenizer = AutoTokenizer.from_pretrained(local["model"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(local["model"])
    args = [f"data.train_files={local['gsm8k_train']}", f"data.val_files={local['gsm8k_test']}", "data.max_prompt_length=1024",
            "actor_rollout_ref.model.path=m"]
    assert check_main(localize(args, local)) == 0
    plain = capsys.readouterr().out
    assert check_main(localize([*args, KWARG], local)) == 0, _problems(capsys.readouterr().out)
    off = capsys.readouterr().out
    for split in ("train", "val"):
        assert _longest(off, split) == _longest(plain, split) + len(OPENING)
