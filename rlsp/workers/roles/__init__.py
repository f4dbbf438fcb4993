"""Roles a worker is assembled from: actor, reference, rollout, critic, reward model (one class each, no ray)."""

from rlsp.workers.roles.actor import ActorRole
from rlsp.workers.roles.critic import CriticRole
from rlsp.workers.roles.reference import ReferenceRole
from rlsp.workers.roles.reward_model import RewardModelRole
from rlsp.workers.roles.rollout import RolloutRole
from rlsp.workers.roles.teacher import TeacherRole

ROLE_CLASSES: dict[str, type] = {"actor": ActorRole, "ref": ReferenceRole, "rollout": RolloutRole, "critic": CriticRole,
                                 "reward_model": RewardModelRole, "teacher": TeacherRole}

__all__ = ["ROLE_CLASSES", "ActorRole", "CriticRole", "ReferenceRole", "RewardModelRole", "RolloutRole", "TeacherRole"]
