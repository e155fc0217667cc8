"""The context cache inside the Program: what the worker's physical truth is made of.

One part per job (docs/structures.md, "What is physically true"): the KV directory, the state
slots, the checkpoints and their owners, Host placement, the context transaction, the writers
(bind, pause, freeze, release) and the captures. ``contract.ContextCache`` is what reclaim and
the worker may rely on; ``native/program.py`` is the façade that wires the parts together.
"""
