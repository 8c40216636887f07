"""Routing: which backends serve a request.

``groups`` holds the prefill and decode endpoints with their load and cooldowns,
``health`` checks them and learns their models, ``affinity`` hashes a prompt's
prefix, and ``prefill`` picks the prefill endpoint from those facts (bounded load,
short-prompt skip, the allowed target a client names).
"""

from .affinity import PromptFacts, prompt_facts
from .groups import BackendGroup, PrefillTargetAllowList
from .health import HealthMonitor
from .prefill import PrefillChooser, TargetRefused

__all__ = ["BackendGroup", "HealthMonitor", "PrefillChooser", "PrefillTargetAllowList",
           "PromptFacts", "TargetRefused", "prompt_facts"]
