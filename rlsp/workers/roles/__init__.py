"""Roles a worker is assembled from: actor, reference, rollout, critic (one class each, no ray)."""

from rlsp.workers.roles.actor import ActorRole
from rlsp.workers.roles.critic import CriticRole
from rlsp.workers.roles.reference import ReferenceRole
from rlsp.workers.roles.rollout import RolloutRole

ROLE_CLASSES: dict[str, type] = {"actor": ActorRole, "ref": ReferenceRole, "rollout": RolloutRole, "critic": CriticRole}

__all__ = ["ROLE_CLASSES", "ActorRole", "CriticRole", "ReferenceRole", "RolloutRole"]
