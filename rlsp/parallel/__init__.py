"""Parallelism: device mesh and parallel dims, Ulysses sequence-parallel all-to-alls, head layout planner."""
