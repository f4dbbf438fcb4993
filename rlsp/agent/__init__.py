"""Agentic (multi-turn, tool-using) rollouts: tools, tool-call parsing, token-exact chat turns and agent loops.

Used by the rollout role; uses the rollout engines. Token ids are built here once, turn by turn, and never
re-rendered from text (docs/agents.md).
"""
