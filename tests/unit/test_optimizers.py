"""optim.optimizer / optimizer_impl / override_optimizer_config (verl's keys, actor and critic): a torch.optim class
by verl's name, given lr and weight_decay, betas for the Adam family, then the override on top (verl's rule).
One step of the engine's optimizer equals the same class built by hand (the same code: every element equal);
names rlsp cannot train with, a wrong case and unknown arguments are refused naming the legal ones."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from rlsp.config.choices import OPTIMIZERS, REFUSED_OPTIMIZERS
from rlsp.config.compose import compose_collecting, parse_command_line
from rlsp.config.validate_verl import check_verl_keys
from rlsp.engine.optim import OptimSettings, build_optimizer, optimizer_kwargs
from rlsp.workers.roles.common import optim_settings


def _step(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    x = torch.randn(8, 4)
    module(x).square().sum().backward()
    optimizer.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_is_torchs_class_with_verls_arguments(name):
    overrides = {"momentum": 0.9, "nesterov": True} if name == "SGD" else {}
    s = OptimSettings(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, name=name, overrides=overrides)
    expected = {"lr": 1e-2, "weight_decay": 0.1, **({"betas": (0.8, 0.95)} if "adam" in name.lower() else {}),
                **overrides}
    assert optimizer_kwargs(s) == expected
    torch.manual_seed(0)
    ours, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(ours.state_dict())
    optimizer, _ = build_optimizer(ours, s)
    assert type(optimizer) is getattr(torch.optim, name)
    _step(ours, optimizer)
    _step(ref, getattr(torch.optim, name)(ref.parameters(), **expected))
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_refusals_name_the_value_and_the_legal_ones():
    for name, reason in REFUSED_OPTIMIZERS.items():
        with pytest.raises(ValueError, match=f"optim.optimizer='{name}' is not supported") as err:
            build_optimizer(nn.Linear(2, 2), OptimSettings(name=name))
        assert reason[:20] in str(err.value) and "'AdamW'" in str(err.value)
    with pytest.raises(ValueError, match="case-sensitive, as in verl: 'AdamW'"):
        build_optimizer(nn.Linear(2, 2), OptimSettings(name="adamw"))
    with pytest.raises(ValueError, match=r"optimizer_impl='bitsandbytes.optim' .*\['torch.optim'\]"):
        build_optimizer(nn.Linear(2, 2), OptimSettings(impl="bitsandbytes.optim"))
    with pytest.raises(ValueError, match=r"sets \['momentum'\], which torch.optim.AdamW does not take; legal keys: .*amsgrad"):
        build_optimizer(nn.Linear(2, 2), OptimSettings(overrides={"momentum": 0.9}))


def _cfg(*overrides: str):
    cfg, problems = compose_collecting(parse_command_line(["--config-name", "verl", *overrides]))
    assert not problems, problems
    return cfg


def test_config_keys_reach_the_engine_settings_and_bad_values_are_refused_at_start_up():
    cfg = _cfg("critic.optim.optimizer=SGD", "+critic.optim.override_optimizer_config.momentum=0.5",
               "+actor_rollout_ref.actor.optim.override_optimizer_config.eps=1e-6")
    critic, actor = optim_settings(cfg, "critic"), optim_settings(cfg, "actor")
    assert (critic.name, critic.overrides, actor.name, actor.overrides) == ("SGD", {"momentum": 0.5}, "AdamW", {"eps": 1e-6})
    assert optimizer_kwargs(actor)["eps"] == 1e-6
    errors: list[str] = []
    check_verl_keys(_cfg("actor_rollout_ref.actor.optim.optimizer=Muon", "critic.optim.optimizer_impl=torchao.optim",
                         "critic.optim.override_optimizer_config=null"), errors)
    assert any("optimizer='Muon' is not supported (torch's Muon" in e for e in errors), errors
    assert any("critic.optim.optimizer_impl='torchao.optim' is not supported; legal values: ['torch.optim']" in e
               for e in errors), errors
    assert len([e for e in errors if "optim" in e]) == 2  # null override: no extra arguments
    assert optim_settings(OmegaConf.merge(cfg, {"critic": {"optim": {"override_optimizer_config": None}}}),
                          "critic").overrides == {}
