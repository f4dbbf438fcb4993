"""Leaf helpers shared by every layer: logging, seeding, timing."""
