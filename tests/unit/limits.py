"""Gate limits for tests: what the service builds from its default settings, changed field by field.

`GateLimits` has no defaults of its own (the settings are the one source); a test names every value
it relies on that differs from the service's defaults.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from extproc.admission import gate_limits
from extproc.config import load_settings
from extproc.gate import GateLimits

_SETTINGS = load_settings({"ADMISSION_OBSERVE_MODELS": "m"})
SERVICE_DEFAULTS = gate_limits(_SETTINGS, _SETTINGS.engines[0])
#: The count-only gate (no KV budget, so no engine queue slots): running + waiting vs max in-flight.
COUNT_ONLY = {"kv_budget": False, "engine_queue_slots": 0}


def limits(**fields: Any) -> GateLimits:
    """The service's default gate limits with `fields` changed."""
    return replace(SERVICE_DEFAULTS, **fields)
