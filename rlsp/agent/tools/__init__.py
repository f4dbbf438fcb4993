"""Tools an agent loop can call: the async tool interface, loading from verl's tool YAML or from typed Python
functions, built-in tools, and the per-trajectory session that runs calls with timeouts and limits."""
