"""`trainer.ray_address`: unset means a private local Ray whatever the environment says, except for a
driver that `ray job submit` started (it joins its cluster); `auto` or an address joins a cluster."""

from __future__ import annotations

import pytest

from rlsp.controller.ray_session import RAY_JOB_ENV, ray_address


@pytest.mark.parametrize("setting", [None, "", "local"])
def test_unset_is_private_even_with_ray_address_exported(monkeypatch, setting):
    monkeypatch.delenv(RAY_JOB_ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(setting) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(setting) is None


def test_a_submitted_job_joins_its_cluster(monkeypatch):
    monkeypatch.setenv(RAY_JOB_ENV, "{}")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(None) == "10.0.0.1:6379"


@pytest.mark.parametrize("setting", ["auto", "10.0.0.2:6379", "ray://10.0.0.2:10001"])
def test_auto_or_an_address_joins(monkeypatch, setting):
    monkeypatch.delenv(RAY_JOB_ENV, raising=False)
    assert ray_address(setting) == setting
