"""Workers: one plain class per role (no ray import); the controller wraps them as Ray actors."""
