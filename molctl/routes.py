"""The four adapter labels of a Mixture-of-LoRA stack (L0 general chat and routing, L1
personal-agent workflows, L2 coding and terminal, L3 UI generation): the names of the profile's
adapters, the route hop's answers and the metrics' `adapter` label. A leaf: it imports nothing."""

ROUTES = ("L0", "L1", "L2", "L3")
